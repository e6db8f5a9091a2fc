//! The chat family: multi-turn sessions whose context grows turn by turn.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::request::{GenParams, WorkloadError, WorkloadRequest};
use super::synth::{check_range, positive, push_text, tokens_in, Arrivals, Thread, FAMILY_CHAT};

/// Multi-turn chat: `concurrent_sessions` conversations are open at a time; each arrival takes
/// the next turn of a random open one. Turn k's prompt is turn k−1's prompt + the previous
/// answer + a new user message, so each turn extends the one before; every session starts with
/// the same short system prompt. A session that has had `turns` turns is replaced by a new one.
#[derive(Clone, Debug)]
pub struct ChatParams {
    /// Conversations open at once. Default 32.
    pub concurrent_sessions: usize,
    /// Turns per conversation range. Default 4..=12.
    pub turns: (u32, u32),
    /// System prompt shared by every session. Default 512 tokens.
    pub system_tokens: u32,
    /// User message length range. Default 64..=512 tokens.
    pub user_tokens: (u32, u32),
    /// Answer length range (output, then part of the next turn's prompt). Default 64..=384.
    pub answer_tokens: (u32, u32),
}

impl Default for ChatParams {
    fn default() -> Self {
        ChatParams {
            concurrent_sessions: 32,
            turns: (4, 12),
            system_tokens: 512,
            user_tokens: (64, 512),
            answer_tokens: (64, 384),
        }
    }
}

/// Generates [`ChatParams`] requests.
pub fn chat(p: &ChatParams, gen: &GenParams) -> Result<Vec<WorkloadRequest>, WorkloadError> {
    gen.validate()?;
    positive("concurrent_sessions", p.concurrent_sessions)?;
    check_range("turns", p.turns)?;
    check_range("user_tokens", p.user_tokens)?;
    check_range("answer_tokens", p.answer_tokens)?;
    let mut rng = SmallRng::seed_from_u64(gen.seed);
    let mut arrivals = Arrivals {
        t: 0.0,
        rate: gen.rate,
    };
    let mut next_id = 0u64;
    let mut open_thread = |rng: &mut SmallRng| {
        let mut segments = Vec::new();
        push_text(&mut segments, FAMILY_CHAT, u64::MAX, 0, p.system_tokens);
        next_id += 1;
        Thread {
            id: next_id - 1,
            segments,
            turn: 0,
            turns: tokens_in(rng, p.turns),
            last_output: 0,
        }
    };
    let mut open: Vec<Thread> = (0..p.concurrent_sessions)
        .map(|_| open_thread(&mut rng))
        .collect();
    let mut out = Vec::with_capacity(gen.requests);
    while out.len() < gen.requests {
        let k = rng.random_range(0..open.len());
        let s = &mut open[k];
        if s.turn > 0 {
            push_text(
                &mut s.segments,
                FAMILY_CHAT,
                s.id,
                u64::from(s.turn) << 1 | 1,
                s.last_output,
            );
        }
        let user = tokens_in(&mut rng, p.user_tokens);
        push_text(
            &mut s.segments,
            FAMILY_CHAT,
            s.id,
            u64::from(s.turn) << 1,
            user,
        );
        let output = tokens_in(&mut rng, p.answer_tokens);
        out.push(WorkloadRequest {
            at_s: arrivals.next(&mut rng),
            segments: s.segments.clone(),
            output_tokens: output,
            session: Some(format!("chat-{}", s.id)),
            affinity: None,
            tenant: None,
        });
        s.last_output = output;
        s.turn += 1;
        if s.turn >= s.turns {
            open[k] = open_thread(&mut rng);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::workload::testing::*;

    #[test]
    fn chat_turns_extend_the_previous_turn_of_their_session() {
        let reqs = chat(&ChatParams::default(), &gen(600)).unwrap();
        let mut last: HashMap<&str, &WorkloadRequest> = HashMap::new();
        let mut extended = 0;
        for r in &reqs {
            let s = r.session.as_deref().unwrap();
            if let Some(prev) = last.get(s) {
                assert!(r.segments.len() > prev.segments.len() + 1);
                assert_eq!(&r.segments[..prev.segments.len()], &prev.segments[..]);
                // The answer of the previous turn has its output length.
                assert_eq!(
                    r.segments[prev.segments.len()].1,
                    prev.output_tokens.min(512)
                );
                extended += 1;
            }
            last.insert(s, r);
        }
        assert!(extended > 400, "{extended}");
        // All sessions share the system prompt, and nothing more across sessions.
        let a = reqs
            .iter()
            .find(|r| r.session.as_deref() == Some("chat-0"))
            .unwrap();
        let b = reqs
            .iter()
            .find(|r| r.session.as_deref() == Some("chat-1"))
            .unwrap();
        assert_eq!(leading_common(a, b), 1);
    }
}
