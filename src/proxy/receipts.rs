//! Receipts: for every answered request, the prefix tokens the node predicted cached at the
//! replica it chose against what the engine reports it served from cache.
//!
//! Exists to close the loop on each decision: "was this miss the router, a stale index or the
//! workload?". The engine's count is read from the answer as it streams past — the last
//! `"cached_tokens":N` (OpenAI chat and completions' `prompt_tokens_details`, Responses'
//! `input_tokens_details`) or `"cache_read_input_tokens":N` (Anthropic) in the body — without
//! buffering or delaying a byte: each chunk is searched once, and the last 64 bytes of the one
//! before are searched again with the new chunk's head, so a field split across chunks is
//! still found. An answer counts when it ends, or when it is dropped after the report passed (a
//! client may stop reading at `[DONE]`). An answer that ends without a report (a stream without
//! `include_usage`, an engine without prompt-token details) is counted as such, never guessed;
//! a broken one not at all.
//!
//! A decision that told the replica to pull part of the prefix from another (a KV-fetch hint,
//! `core::kv_fetch`) predicts those tokens cached too — engines report pulled tokens in
//! `cached_tokens` — and counts them apart (`kvmesh_receipt_fetch_planned_tokens_total`), so
//! precision shows whether pulls arrive. A pull from a holder another region's offer named is
//! also judged: one that brought less than half its plan tells the node, which leaves a holder
//! whose pulls keep coming back empty out of the offers (`core::empty_holders`).

use memchr::memmem;

use std::sync::Arc;

use crate::core::dialect::Api;
use crate::core::empty_holders::is_empty_pull;
use crate::core::router::Branch;
use crate::node::Node;

/// The largest count of cached tokens believed from an engine: beyond any context window, so a
/// larger (broken or hostile) report is clamped rather than swamping the counters.
const MAX_REPORTED: u64 = 1 << 32;

/// Bytes of a chunk kept to search again with the next one: a needle, `:`, spaces and 20 digits.
const CARRY: usize = 64;

/// The usage fields that count prompt tokens served from cache.
const NEEDLES: [&[u8]; 2] = [b"\"cached_tokens\"", b"\"cache_read_input_tokens\""];

/// The engine's reported cached tokens, found in a byte stream (no allocation: the carried
/// bytes live in the scan itself).
#[derive(Debug)]
pub(crate) struct UsageScan {
    /// The stream's last bytes (at most [`CARRY`]), `carry[..carried]`.
    carry: [u8; CARRY],
    carried: usize,
    /// The last value seen, if any.
    pub last: Option<u64>,
}

impl Default for UsageScan {
    fn default() -> Self {
        UsageScan {
            carry: [0; CARRY],
            carried: 0,
            last: None,
        }
    }
}

impl UsageScan {
    /// Searches one more chunk of the answer.
    pub fn feed(&mut self, chunk: &[u8]) {
        // The carried bytes and the chunk's head, for a field split between them.
        let mut joined = [0u8; 2 * CARRY];
        let head = chunk.len().min(CARRY);
        joined[..self.carried].copy_from_slice(&self.carry[..self.carried]);
        joined[self.carried..self.carried + head].copy_from_slice(&chunk[..head]);
        // Only matches that start in the carried bytes: the rest are the chunk's own.
        self.search(&joined[..self.carried + head], self.carried);
        self.search(chunk, chunk.len());
        // The stream's last bytes, whatever the chunks' sizes.
        let tail = if chunk.len() >= CARRY {
            &chunk[chunk.len() - CARRY..]
        } else {
            let total = self.carried + head;
            &joined[total.saturating_sub(CARRY)..total]
        };
        self.carry[..tail.len()].copy_from_slice(tail);
        self.carried = tail.len();
    }

    /// Reads every needle starting before `starts_before` whose number ends inside `hay`.
    fn search(&mut self, hay: &[u8], starts_before: usize) {
        for needle in NEEDLES {
            for at in memmem::find_iter(hay, needle) {
                if at >= starts_before {
                    break;
                }
                if let Some(n) = number_after(&hay[at + needle.len()..]) {
                    self.last = Some(n);
                }
            }
        }
    }
}

/// The integer after `:` (spaces allowed), when its last digit is not the input's last byte (a
/// number at the end may continue in the next chunk; it is read again with the carry).
fn number_after(rest: &[u8]) -> Option<u64> {
    let rest = trim_start(rest);
    let rest = trim_start(rest.strip_prefix(b":")?);
    let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    if digits == 0 || digits == rest.len() || digits > 19 {
        return None;
    }
    let n: u64 = std::str::from_utf8(&rest[..digits]).ok()?.parse().ok()?;
    Some(n.min(MAX_REPORTED))
}

fn trim_start(b: &[u8]) -> &[u8] {
    let n = b.iter().take_while(|c| c.is_ascii_whitespace()).count();
    &b[n..]
}

/// What the relay of one answer records when the answer ends.
pub(crate) struct Receipt {
    api: Api,
    branch: Option<Branch>,
    /// Predicted cached: the replica's own hit plus any planned pull.
    predicted: u64,
    /// Of `predicted`, the tokens a KV-fetch hint asked it to pull.
    fetch_planned: u64,
    /// The pull's source when another region's offer named it, judged when the answer ends.
    offered: Option<OfferedPull>,
    scan: UsageScan,
}

/// A pull from a holder another region's offer named (`KvFetchPlan::offer_key`).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct OfferedPull {
    /// The holder's URL, as the hint named it.
    pub holder: Arc<str>,
    /// Prompt tokens the target was believed to hold (the pull starts there).
    pub from_tokens: u64,
}

impl Receipt {
    /// A receipt for an answer to an `api` request routed by `branch`, predicted to find
    /// `predicted` prompt tokens cached.
    pub fn new(api: Api, branch: Option<Branch>, predicted: u64) -> Self {
        Receipt {
            api,
            branch,
            predicted,
            fetch_planned: 0,
            offered: None,
            scan: UsageScan::default(),
        }
    }

    /// The replica was also told to pull `tokens` prompt tokens (they count as predicted
    /// cached, and apart).
    pub fn fetching(mut self, tokens: u64) -> Self {
        self.predicted += tokens;
        self.fetch_planned = tokens;
        self
    }

    /// The pull's source is a holder another region's offer named: judge the pull by the answer.
    pub fn offered(mut self, pull: Option<OfferedPull>) -> Self {
        self.offered = pull;
        self
    }

    /// Whether the answer (its engine reporting `reported` cached) says the offered holder's
    /// pull came back empty.
    fn offered_pull_empty(&self, reported: u64) -> Option<&OfferedPull> {
        self.offered
            .as_ref()
            .filter(|p| is_empty_pull(reported, p.from_tokens, self.fetch_planned))
    }

    /// Searches one more chunk.
    pub fn feed(&mut self, chunk: &[u8]) {
        self.scan.feed(chunk);
    }

    /// Whether the engine's report has passed.
    pub fn reported(&self) -> bool {
        self.scan.last.is_some()
    }

    /// The answer ended: count the prediction against the report.
    pub fn finish(&self, node: &Node) {
        let branch = self.branch.map_or("pd", Branch::as_str);
        let labels = [self.api.as_str(), branch];
        let m = &node.metrics.receipts;
        let Some(reported) = self.scan.last else {
            m.receipts
                .with_label_values(&[labels[0], labels[1], "no_usage"])
                .inc();
            return;
        };
        m.receipts
            .with_label_values(&[labels[0], labels[1], "reported"])
            .inc();
        m.predicted
            .with_label_values(&labels)
            .inc_by(self.predicted);
        m.reported.with_label_values(&labels).inc_by(reported);
        if self.fetch_planned > 0 {
            m.fetch_planned
                .with_label_values(&labels)
                .inc_by(self.fetch_planned);
        }
        m.matched
            .with_label_values(&labels)
            .inc_by(self.predicted.min(reported));
        m.error_tokens
            .observe(reported as f64 - self.predicted as f64);
        if let Some(p) = self.offered_pull_empty(reported) {
            node.note_empty_pull(&p.holder);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan(chunks: &[&str]) -> Option<u64> {
        let mut s = UsageScan::default();
        for c in chunks {
            s.feed(c.as_bytes());
        }
        s.last
    }

    #[test]
    fn a_planned_pull_counts_as_predicted_cached_and_apart() {
        let r = Receipt::new(Api::Chat, None, 64);
        assert_eq!((r.predicted, r.fetch_planned), (64, 0));
        let r = r.fetching(192);
        assert_eq!((r.predicted, r.fetch_planned), (256, 192));
    }

    #[test]
    fn an_offered_pull_that_brought_less_than_half_its_plan_is_empty() {
        let pull = OfferedPull {
            holder: Arc::from("http://10.0.0.7:8000"),
            from_tokens: 64,
        };
        let r = Receipt::new(Api::Chat, None, 64)
            .fetching(8192)
            .offered(Some(pull.clone()));
        assert_eq!(r.offered_pull_empty(64), Some(&pull));
        assert_eq!(r.offered_pull_empty(64 + 4095), Some(&pull));
        assert_eq!(r.offered_pull_empty(64 + 4096), None);
        // A pull from a replica in the view is not judged here.
        let r = Receipt::new(Api::Chat, None, 64).fetching(8192);
        assert_eq!(r.offered_pull_empty(0), None);
    }

    #[test]
    fn reads_each_api_usage_shape() {
        let chat = r#"{"usage":{"prompt_tokens":90,"prompt_tokens_details":{"cached_tokens":64}}}"#;
        assert_eq!(scan(&[chat]), Some(64));
        let anthropic = "event: message_start\ndata: {\"usage\":{\"input_tokens\":3,\"cache_read_input_tokens\": 128,\"output_tokens\":1}}\n\n";
        assert_eq!(scan(&[anthropic]), Some(128));
        let none = r#"{"choices":[{"text":"cached_tokens are great"}]}"#;
        assert_eq!(scan(&[none]), None);
        let huge = r#"{"cached_tokens":9999999999999999999,"x":1}"#;
        assert_eq!(
            scan(&[huge]),
            Some(MAX_REPORTED),
            "a wild report is clamped"
        );
        let longer = r#"{"cached_tokens":99999999999999999999999,"x":1}"#;
        assert_eq!(scan(&[longer]), None, "too many digits is not a number");
    }

    #[test]
    fn the_last_report_wins_and_a_split_field_is_found() {
        let body = r#"data: {"usage":{"cached_tokens":5}}

data: {"usage":{"prompt_tokens_details":{"cached_tokens":1234}}}
"#;
        for cut in 0..body.len() {
            let (a, b) = body.split_at(cut);
            assert_eq!(scan(&[a, b]), Some(1234), "cut at {cut}");
        }
        let small: Vec<String> = body.chars().map(String::from).collect();
        let parts: Vec<&str> = small.iter().map(String::as_str).collect();
        assert_eq!(scan(&parts), Some(1234), "one byte a chunk");
    }
}
