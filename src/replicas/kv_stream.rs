//! The sequence/replay state machine of one KV-event stream (one replica, one data-parallel rank).
//!
//! Exists so the ordering rules of engines.md §7 live in plain synchronous code that tests can
//! drive message by message, while the ZMQ sockets around it stay a thin loop
//! (`replicas::kv_events`). The tracker is fed live messages `(seq, payload)`, replayed messages
//! and the end (or failure) of a replay, and answers with [`Action`]s in the order they must be
//! carried out:
//!
//! - `seq == expect` → apply;
//! - `seq > expect` (a gap) → ask the replay socket for everything from `expect`, buffer live
//!   messages meanwhile, apply replies in order; a first reply past `expect` means the publisher no
//!   longer has that history → clear the replica and go on from what it has;
//! - `seq < expect` → the publisher restarted (its counter starts at 0 again) → clear, go on;
//! - no replay endpoint → a gap clears the replica (unknown blocks only lower its scores);
//! - at startup, replay from 0 so blocks stored before the node started are known.
//!
//! Live messages that arrive during a replay are buffered, at most [`MAX_BUFFERED`] of them and
//! at most `max_buffered_bytes` (default [`DEFAULT_MAX_BUFFERED_BYTES`]) of payload; past either
//! the replay is abandoned and the replica cleared. The one promise, checked by a randomised
//! test: between two clears, applied sequences strictly increase.

use std::collections::VecDeque;

use bytes::Bytes;

/// Live messages held while a replay is running; past this the replay is abandoned (the live
/// stream outran it) and the replica cleared.
pub const MAX_BUFFERED: usize = 4096;
/// Default bound on the payload bytes buffered during a replay.
pub const DEFAULT_MAX_BUFFERED_BYTES: usize = 64 << 20;

/// What the I/O loop must do, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Decode and apply this batch.
    Apply {
        /// Its sequence number.
        seq: u64,
        /// The msgpack `EventBatch`.
        payload: Bytes,
    },
    /// Forget every block of this stream: what it knows is no longer trustworthy.
    Clear(ClearReason),
    /// Send a replay request for every batch from this sequence on.
    RequestReplay {
        /// First sequence wanted.
        from: u64,
    },
}

/// Why a stream's blocks were cleared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClearReason {
    /// A gap that no replay could fill (no replay endpoint, or the replay failed).
    Gap,
    /// The replay started after the sequence asked for: the publisher dropped that history.
    HistoryLost,
    /// The sequence went backwards: the publisher restarted.
    Restarted,
    /// Live messages piled up past [`MAX_BUFFERED`] during a replay.
    ReplayOverflow,
}

impl ClearReason {
    /// Label for metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            ClearReason::Gap => "gap",
            ClearReason::HistoryLost => "history_lost",
            ClearReason::Restarted => "restarted",
            ClearReason::ReplayOverflow => "replay_overflow",
        }
    }
}

#[derive(Debug)]
enum Mode {
    Live,
    Replaying {
        /// The sequence asked for.
        from: u64,
        /// Whether a reply arrived yet (the first one decides whether history was lost).
        got_reply: bool,
        /// Live messages that arrived meanwhile, in arrival order.
        buffered: VecDeque<(u64, Bytes)>,
        /// Their payload bytes.
        buffered_bytes: usize,
    },
}

/// Sequence tracking of one stream. Sans-IO: feed it messages, carry out the returned actions.
#[derive(Debug)]
pub struct SeqTracker {
    /// Next sequence expected; `None` until the first message (or after a replay that found the
    /// publisher had sent nothing yet), when any sequence is accepted.
    expect: Option<u64>,
    mode: Mode,
    can_replay: bool,
    max_buffered_bytes: usize,
}

impl SeqTracker {
    /// A tracker for a stream with (`can_replay`) or without a replay endpoint.
    pub fn new(can_replay: bool) -> Self {
        SeqTracker {
            expect: None,
            mode: Mode::Live,
            can_replay,
            max_buffered_bytes: DEFAULT_MAX_BUFFERED_BYTES,
        }
    }

    /// The same, buffering at most `bytes` of payload during a replay.
    pub fn with_max_buffered_bytes(mut self, bytes: usize) -> Self {
        self.max_buffered_bytes = bytes;
        self
    }

    /// Whether a replay is in progress.
    pub fn replaying(&self) -> bool {
        matches!(self.mode, Mode::Replaying { .. })
    }

    /// The next sequence expected, if any is.
    pub fn expect(&self) -> Option<u64> {
        self.expect
    }

    /// At startup (and after a reconnect that may have lost messages): with a replay endpoint,
    /// ask for everything from 0 so blocks stored before we connected are known.
    pub fn start(&mut self) -> Vec<Action> {
        if !self.can_replay || self.replaying() {
            return Vec::new();
        }
        self.begin_replay(self.expect.unwrap_or(0), VecDeque::new())
    }

    fn begin_replay(&mut self, from: u64, buffered: VecDeque<(u64, Bytes)>) -> Vec<Action> {
        let buffered_bytes = buffered.iter().map(|(_, p)| p.len()).sum();
        self.mode = Mode::Replaying {
            from,
            got_reply: false,
            buffered,
            buffered_bytes,
        };
        vec![Action::RequestReplay { from }]
    }

    /// A live message from the SUB socket.
    pub fn live(&mut self, seq: u64, payload: Bytes) -> Vec<Action> {
        if let Mode::Replaying {
            buffered,
            buffered_bytes,
            ..
        } = &mut self.mode
        {
            let bytes = buffered_bytes.saturating_add(payload.len());
            if buffered.len() >= MAX_BUFFERED || bytes > self.max_buffered_bytes {
                // The replay is not keeping up; give it up and restart from the live stream.
                self.mode = Mode::Live;
                self.expect = Some(seq.wrapping_add(1));
                return vec![
                    Action::Clear(ClearReason::ReplayOverflow),
                    Action::Apply { seq, payload },
                ];
            }
            *buffered_bytes = bytes;
            buffered.push_back((seq, payload));
            return Vec::new();
        }
        let Some(expect) = self.expect else {
            self.expect = Some(seq.wrapping_add(1));
            return vec![Action::Apply { seq, payload }];
        };
        if seq == expect {
            self.expect = Some(seq.wrapping_add(1));
            vec![Action::Apply { seq, payload }]
        } else if seq < expect {
            self.expect = Some(seq.wrapping_add(1));
            vec![
                Action::Clear(ClearReason::Restarted),
                Action::Apply { seq, payload },
            ]
        } else if self.can_replay {
            self.begin_replay(expect, VecDeque::from([(seq, payload)]))
        } else {
            self.expect = Some(seq.wrapping_add(1));
            vec![
                Action::Clear(ClearReason::Gap),
                Action::Apply { seq, payload },
            ]
        }
    }

    /// One replayed message `["", seq, payload]`. Ignored when no replay is running (a late
    /// answer to an abandoned request).
    pub fn replayed(&mut self, seq: u64, payload: Bytes) -> Vec<Action> {
        let Mode::Replaying {
            from, got_reply, ..
        } = &mut self.mode
        else {
            return Vec::new();
        };
        let first = !*got_reply;
        *got_reply = true;
        let expect = self.expect.unwrap_or(*from);
        let mut out = Vec::new();
        if seq < expect {
            // Already applied (a duplicate); nothing to do.
            return out;
        }
        if seq > expect {
            // The first reply past what we asked for: the publisher's ring no longer holds it.
            // (A hole later in a replay means the same.) Start again from what it has.
            let reason = if first {
                ClearReason::HistoryLost
            } else {
                ClearReason::Gap
            };
            // At startup nothing was known, so clearing is a no-op; say it anyway so the
            // replica's blocks from a previous connection are dropped.
            out.push(Action::Clear(reason));
        }
        self.expect = Some(seq.wrapping_add(1));
        out.push(Action::Apply { seq, payload });
        out
    }

    /// The end marker `["", ff×8, ""]`: apply the live messages buffered meanwhile.
    pub fn replay_done(&mut self) -> Vec<Action> {
        self.finish_replay(false)
    }

    /// The replay could not be done (no answer in time, socket error): clear and go on from the
    /// buffered live messages.
    pub fn replay_failed(&mut self) -> Vec<Action> {
        self.finish_replay(true)
    }

    fn finish_replay(&mut self, failed: bool) -> Vec<Action> {
        let mode = std::mem::replace(&mut self.mode, Mode::Live);
        let Mode::Replaying { buffered, .. } = mode else {
            return Vec::new();
        };
        let mut out = Vec::new();
        if failed {
            out.push(Action::Clear(ClearReason::Gap));
            // Whatever came before the buffer is unknown: accept the buffer's first message.
            self.expect = None;
        }
        for (seq, payload) in buffered {
            match self.expect {
                Some(e) if seq < e => {} // covered by the replay
                Some(e) if seq > e => {
                    // The replay ended short of the live stream: a hole nobody can fill now.
                    out.push(Action::Clear(ClearReason::Gap));
                    self.expect = Some(seq.wrapping_add(1));
                    out.push(Action::Apply { seq, payload });
                }
                _ => {
                    self.expect = Some(seq.wrapping_add(1));
                    out.push(Action::Apply { seq, payload });
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(seq: u64) -> Bytes {
        Bytes::from(seq.to_be_bytes().to_vec())
    }

    fn apply(seq: u64) -> Action {
        Action::Apply {
            seq,
            payload: p(seq),
        }
    }

    fn applied(actions: &[Action]) -> Vec<u64> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::Apply { seq, .. } => Some(*seq),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn in_order_messages_apply_one_by_one() {
        let mut t = SeqTracker::new(false);
        assert!(t.start().is_empty(), "no replay endpoint: nothing to ask");
        // Joining mid-stream: the first sequence seen is accepted.
        assert_eq!(t.live(5, p(5)), vec![apply(5)]);
        assert_eq!(t.live(6, p(6)), vec![apply(6)]);
        assert_eq!(t.expect(), Some(7));
    }

    #[test]
    fn startup_replays_from_zero_and_merges_live_messages() {
        let mut t = SeqTracker::new(true);
        assert_eq!(t.start(), vec![Action::RequestReplay { from: 0 }]);
        // Live messages during the replay are held back.
        assert!(t.live(3, p(3)).is_empty());
        assert!(t.live(4, p(4)).is_empty());
        assert_eq!(t.replayed(0, p(0)), vec![apply(0)]);
        assert_eq!(t.replayed(1, p(1)), vec![apply(1)]);
        assert_eq!(t.replayed(2, p(2)), vec![apply(2)]);
        assert_eq!(t.replayed(3, p(3)), vec![apply(3)]);
        // 3 came twice (replay and live): applied once.
        assert_eq!(t.replay_done(), vec![apply(4)]);
        assert!(!t.replaying());
        assert_eq!(t.live(5, p(5)), vec![apply(5)]);
    }

    #[test]
    fn startup_replay_of_an_idle_publisher_accepts_the_next_live_message() {
        let mut t = SeqTracker::new(true);
        t.start();
        assert!(t.replay_done().is_empty());
        assert_eq!(t.live(0, p(0)), vec![apply(0)]);
    }

    #[test]
    fn gap_requests_replay_from_the_missing_sequence() {
        let mut t = SeqTracker::new(true);
        t.start();
        t.replay_done();
        assert_eq!(t.live(0, p(0)), vec![apply(0)]);
        assert_eq!(t.live(3, p(3)), vec![Action::RequestReplay { from: 1 }]);
        assert!(t.live(4, p(4)).is_empty());
        let mut got = t.replayed(1, p(1));
        got.extend(t.replayed(2, p(2)));
        got.extend(t.replayed(3, p(3)));
        got.extend(t.replay_done());
        assert_eq!(applied(&got), vec![1, 2, 3, 4]);
        assert!(!got.iter().any(|a| matches!(a, Action::Clear(_))));
    }

    #[test]
    fn replay_starting_late_means_history_lost() {
        let mut t = SeqTracker::new(true);
        t.start();
        t.replay_done();
        t.live(0, p(0));
        assert_eq!(t.live(10, p(10)), vec![Action::RequestReplay { from: 1 }]);
        // The ring only reaches back to 8.
        assert_eq!(
            t.replayed(8, p(8)),
            vec![Action::Clear(ClearReason::HistoryLost), apply(8)]
        );
        assert_eq!(t.replayed(9, p(9)), vec![apply(9)]);
        assert_eq!(t.replayed(10, p(10)), vec![apply(10)]);
        assert!(t.replay_done().is_empty(), "10 was already applied");
    }

    #[test]
    fn sequence_going_back_means_restart() {
        let mut t = SeqTracker::new(true);
        t.start();
        t.replay_done();
        for s in 0..5 {
            t.live(s, p(s));
        }
        assert_eq!(
            t.live(0, p(0)),
            vec![Action::Clear(ClearReason::Restarted), apply(0)]
        );
        assert_eq!(t.live(1, p(1)), vec![apply(1)]);
    }

    #[test]
    fn gap_without_replay_endpoint_clears() {
        let mut t = SeqTracker::new(false);
        t.live(0, p(0));
        assert_eq!(
            t.live(2, p(2)),
            vec![Action::Clear(ClearReason::Gap), apply(2)]
        );
        assert_eq!(t.live(3, p(3)), vec![apply(3)]);
    }

    #[test]
    fn failed_replay_clears_and_continues_from_the_buffer() {
        let mut t = SeqTracker::new(true);
        t.start();
        t.replay_done();
        t.live(0, p(0));
        t.live(5, p(5));
        t.live(6, p(6));
        let got = t.replay_failed();
        assert_eq!(got[0], Action::Clear(ClearReason::Gap));
        assert_eq!(applied(&got), vec![5, 6]);
        assert_eq!(t.live(7, p(7)), vec![apply(7)]);
    }

    #[test]
    fn replay_ending_short_of_the_live_stream_clears() {
        let mut t = SeqTracker::new(true);
        t.start();
        t.replay_done();
        t.live(0, p(0));
        t.live(3, p(3));
        t.live(9, p(9));
        let mut got = t.replayed(1, p(1));
        got.extend(t.replayed(2, p(2)));
        got.extend(t.replayed(3, p(3)));
        got.extend(t.replay_done());
        assert_eq!(applied(&got), vec![1, 2, 3, 9]);
        assert_eq!(got.last(), Some(&apply(9)));
        assert!(got.contains(&Action::Clear(ClearReason::Gap)));
    }

    #[test]
    fn late_replies_after_the_replay_ended_are_ignored() {
        let mut t = SeqTracker::new(true);
        t.start();
        t.replay_done();
        assert!(t.replayed(0, p(0)).is_empty());
        assert!(t.replay_done().is_empty());
        assert!(t.replay_failed().is_empty());
    }

    #[test]
    fn buffered_bytes_are_bounded_too() {
        // Ten 1 MiB messages against a 4 MiB budget: the fifth abandons the replay.
        let mut t = SeqTracker::new(true).with_max_buffered_bytes(4 << 20);
        t.start();
        let big = |s: u64| Bytes::from(vec![s as u8; 1 << 20]);
        for s in 0..4u64 {
            assert!(t.live(100 + s, big(s)).is_empty());
        }
        let got = t.live(104, big(4));
        assert_eq!(got[0], Action::Clear(ClearReason::ReplayOverflow));
        assert!(!t.replaying());
    }

    #[test]
    fn buffer_overflow_abandons_the_replay() {
        let mut t = SeqTracker::new(true);
        t.start();
        for s in 0..MAX_BUFFERED as u64 {
            assert!(t.live(100 + s, p(100 + s)).is_empty());
        }
        let s = 100 + MAX_BUFFERED as u64;
        assert_eq!(
            t.live(s, p(s)),
            vec![Action::Clear(ClearReason::ReplayOverflow), apply(s)]
        );
        assert!(!t.replaying());
        assert!(t.replayed(0, p(0)).is_empty(), "stale reply ignored");
    }

    #[test]
    fn random_orders_never_apply_a_sequence_twice_without_a_clear() {
        // Drive the tracker with a pseudo-random interleaving of live and replayed messages and
        // check its one promise: between two clears, applied sequences strictly increase.
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for _ in 0..200 {
            let mut t = SeqTracker::new(next() % 2 == 0);
            let mut actions = t.start();
            let mut live_seq = 0u64;
            for _ in 0..100 {
                actions.extend(match next() % 6 {
                    0 => {
                        live_seq += 1 + next() % 3;
                        t.live(live_seq, p(live_seq))
                    }
                    1 => t.live(live_seq % 4, p(live_seq % 4)),
                    2 => {
                        let s = next() % 20;
                        t.replayed(s, p(s))
                    }
                    3 => t.replay_done(),
                    4 => t.replay_failed(),
                    _ => {
                        live_seq += 1;
                        t.live(live_seq, p(live_seq))
                    }
                });
            }
            let mut last: Option<u64> = None;
            for a in &actions {
                match a {
                    Action::Clear(_) => last = None,
                    Action::Apply { seq, .. } => {
                        assert!(last.is_none_or(|l| *seq > l), "{actions:?}");
                        last = Some(*seq);
                    }
                    Action::RequestReplay { .. } => {}
                }
            }
        }
    }
}
