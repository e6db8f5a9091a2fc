//! Streams that survive their replica: a streamed answer whose replica fails (dies, cuts the
//! connection, ends without its terminator, or goes silent past `timeouts.stream_idle_ms`) is
//! continued on another replica, and the client sees one stream.
//!
//! Exists because an engine dying mid-stream used to reach the client as a bare truncation. The
//! relay (`respond.rs`) hands each chunk of an event stream to a [`StreamGuard`], which passes
//! whole events only (a partial one waits for its end, so a failure never leaves the client half
//! an event) and logs what went by (`core::stream_resume::StreamLog`). On a failure
//! [`StreamGuard::recover`] builds the continuation (the prompt plus the text so far, the token
//! budget left), decides it like a retry (`decide.rs`, every replica that failed it excluded,
//! never forwarded to another region), sends it, and the relay goes on reading the new answer,
//! whose events the log rewrites to read as the first's. At most `retry.stream_resumes`
//! continuations a stream; where none is possible (an unresumable stream, no replica left) the
//! stream ends with an error event in its API's shape. Counted in
//! `kvmesh_stream_resumes_total{api,outcome}`.
//!
//! A continuation is sampled afresh: not the tokens the dead replica would have sent (greedy
//! requests with a seed come closest). A continued answer leaves no receipt.

use std::sync::Arc;
use std::time::Duration;

use axum::http::{header, HeaderMap};
use bytes::Bytes;

use super::decide::{decide, AttemptCtx, Decided};
use super::understand::{understand, Understood};
use crate::core::dialect::Api;
use crate::core::keys::BlockKey;
use crate::core::priority::ClassId;
use crate::core::router::RouteRequest;
use crate::core::stream_resume::{
    continuation_body, error_event, Continuation, SseFramer, StreamLog, Unresumable,
};
use crate::node::{Node, Ticket};

/// What asking again takes: the original request, owned (the relay outlives the handler).
struct Again {
    path: &'static str,
    /// The headers sent upstream (auth already replaced).
    headers: HeaderMap,
    /// The client's body, byte for byte.
    body: Bytes,
    tenant: Option<String>,
    class: Option<ClassId>,
    /// Replicas that failed this stream: never asked to continue it.
    tried: Vec<usize>,
    /// Continuation attempts left (`retry.stream_resumes`).
    left: u32,
    /// KiB of `Node::resume_body_budget` the kept body holds, given back when the guard goes.
    budget_kib: u32,
}

/// Watches one streamed answer for its relay: whole events out, and a continuation when its
/// replica fails.
pub(crate) struct StreamGuard {
    node: Arc<Node>,
    api: Api,
    framer: SseFramer,
    log: StreamLog,
    /// The events now come from a continuation: they are rewritten, not passed.
    continuing: bool,
    /// `None`: the stream cannot be continued (its API, or `retry.stream_resumes = 0`); a
    /// failure ends it with an error event.
    again: Option<Again>,
}

/// What follows a failure.
pub(crate) enum Recovery {
    /// Another replica continues: relay its answer, under its ticket, recording its keys.
    Continued {
        /// Boxed: the variant is returned once per failure, and the answer is large.
        resp: Box<reqwest::Response>,
        ticket: Ticket,
        keys: Vec<BlockKey>,
    },
    /// The stream ends with these bytes (the API's error event, or its proper end).
    End(Bytes),
}

/// Reserves `body`'s size in KiB of the node's budget for bodies kept by resumable streams,
/// without waiting: `None` when it is spent. The body outlives the handler whose read budget
/// held it (`body.rs`), for as long as the stream runs, so it is counted again here.
fn keep_body(node: &Node, body: &Bytes) -> Option<u32> {
    let kib = u32::try_from(body.len().div_ceil(1024)).ok()?;
    let permit = node.resume_body_budget.try_acquire_many(kib).ok()?;
    // Given back by the guard's drop, which outlives any borrow of the node here.
    permit.forget();
    Some(kib)
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        if let Some(again) = &self.again {
            self.node
                .resume_body_budget
                .add_permits(again.budget_kib as usize);
        }
    }
}

impl StreamGuard {
    /// A guard for `resp`, the answer to `u`, when it is a successful event stream of an API
    /// whose streams end with a marker (completions, chat, Messages, Responses).
    pub fn for_answer(
        node: &Arc<Node>,
        u: &Understood,
        headers: &HeaderMap,
        tenant: Option<&str>,
        class: Option<ClassId>,
        resp: &reqwest::Response,
    ) -> Option<Box<Self>> {
        let sse = resp
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        let guarded = matches!(
            u.api,
            Api::Completions | Api::Chat | Api::Messages | Api::Responses
        );
        if !u.stream() || !resp.status().is_success() || !sse || !guarded {
            return None;
        }
        let resumes = node.cfg.retry.stream_resumes;
        let resumable = matches!(u.api, Api::Completions | Api::Chat) && resumes > 0;
        let kept = resumable.then(|| keep_body(node, &u.body)).flatten();
        if resumable && kept.is_none() {
            count(node, u.api, "body_not_kept");
        }
        let again = kept.map(|budget_kib| Again {
            path: u.path,
            headers: headers.clone(),
            body: u.body.clone(),
            tenant: tenant.map(str::to_owned),
            class,
            tried: Vec::new(),
            left: resumes,
            budget_kib,
        });
        Some(Box::new(StreamGuard {
            node: Arc::clone(node),
            api: u.api,
            framer: SseFramer::default(),
            log: StreamLog::new(u.api),
            continuing: false,
            again,
        }))
    }

    /// The bytes to send the client for `chunk` of the replica's answer: the whole events it
    /// completes (possibly none), rewritten when they come from a continuation.
    pub fn pass(&mut self, chunk: Bytes) -> Bytes {
        if self.framer.overflowed {
            return chunk;
        }
        let Some(end) = self.framer.boundary(&chunk) else {
            if self.framer.hold(&chunk) {
                return Bytes::new();
            }
            return self.overflow(&chunk);
        };
        let (events, rest) = (chunk.slice(..end), chunk.slice(end..));
        let out = if self.framer.holding() || self.continuing {
            let mut whole = self.framer.take_held();
            whole.extend_from_slice(&events);
            self.send(whole)
        } else {
            // The common case: the chunk's events pass as they came, without a copy.
            self.log.observe(&events);
            events
        };
        if rest.is_empty() || self.framer.hold(&rest) {
            return out;
        }
        let mut out = out.to_vec();
        out.extend_from_slice(&self.overflow(&rest));
        out.into()
    }

    /// The answer ended. `Some`: the stream is complete, with these last bytes to send (an
    /// event the engine sent without its blank line); `None`: it ended early, and what is
    /// held (a partial event) is dropped.
    pub fn end(&mut self) -> Option<Bytes> {
        let held = self.framer.take_held();
        if !self.complete() {
            let mut probe = self.log.clone();
            probe.observe(&held);
            if held.is_empty() || !probe.done {
                return None;
            }
        }
        Some(if held.is_empty() {
            Bytes::new()
        } else {
            self.send(held)
        })
    }

    /// Whether the stream's end went by (or can no longer be told: an unframed stream).
    fn complete(&self) -> bool {
        self.log.done || self.framer.overflowed
    }

    /// Whole events for the client, logged (and rewritten from a continuation).
    fn send(&mut self, whole: Vec<u8>) -> Bytes {
        if !self.continuing {
            self.log.observe(&whole);
            return whole.into();
        }
        let mut out = Vec::with_capacity(whole.len() + 64);
        self.log.rewrite(&whole, &mut out);
        out.into()
    }

    /// An event too big to hold: what is held and `rest` pass unframed, and so does the rest of
    /// the stream, which can no longer be continued.
    fn overflow(&mut self, rest: &[u8]) -> Bytes {
        self.log.unresumable = Some(Unresumable::TooLong);
        let mut held = self.framer.take_held();
        held.extend_from_slice(rest);
        held.into()
    }

    /// The replica `failed` broke the stream (`why`): continue it elsewhere, or end it with the
    /// API's error event.
    pub async fn recover(&mut self, failed: usize, why: &str) -> Recovery {
        // The failed replica's partial event is never sent.
        self.framer.clear();
        let Some(again) = self.again.as_mut() else {
            return match self.log.unresumable {
                Some(u) => self.give_up(u.as_str()),
                None => self.give_up(why),
            };
        };
        again.tried.push(failed);
        let body = match continuation_body(&again.body, &self.log) {
            Ok(Continuation::Body(b)) => Bytes::from(b),
            Ok(Continuation::Finished(end)) => {
                self.count("finished");
                return Recovery::End(end.into());
            }
            Err(why) => return self.give_up(why.as_str()),
        };
        while again.left > 0 {
            again.left -= 1;
            match ask(&self.node, self.api, again, &body).await {
                Ok((resp, ticket, keys)) => {
                    self.count("resumed");
                    tracing::info!(api = self.api.as_str(), replica = %ticket.endpoint().id,
                        tokens_sent = self.log.tokens(), "stream continued on another replica");
                    self.continuing = true;
                    self.log.next_leg();
                    return Recovery::Continued {
                        resp: Box::new(resp),
                        ticket,
                        keys,
                    };
                }
                Err(Some(replica)) => {
                    again.tried.push(replica);
                    count(&self.node, self.api, "failed");
                }
                Err(None) => break,
            }
        }
        self.give_up("no replica could continue the stream")
    }

    fn give_up(&self, why: &str) -> Recovery {
        self.count("error_event");
        tracing::warn!(
            api = self.api.as_str(),
            reason = why,
            "stream ended with an error event"
        );
        let message = format!("the stream's replica failed and {why}");
        Recovery::End(error_event(self.api, &message, self.log.events).into())
    }

    fn count(&self, outcome: &str) {
        count(&self.node, self.api, outcome);
    }
}

/// Counts one outcome in `kvmesh_stream_resumes_total`.
fn count(node: &Node, api: Api, outcome: &str) {
    node.metrics
        .stream_resumes
        .with_label_values(&[api.as_str(), outcome])
        .inc();
}

/// One continuation attempt: decided like a retry, sent, answered with a successful stream.
/// `Err(Some(i))`: replica `i` failed it; `Err(None)`: no replica to ask.
async fn ask(
    node: &Arc<Node>,
    api: Api,
    again: &Again,
    body: &Bytes,
) -> Result<(reqwest::Response, Ticket, Vec<BlockKey>), Option<usize>> {
    let tenant = again.tenant.as_deref();
    let u = understand(node, api, again.path, body.clone(), tenant)
        .await
        .map_err(|_| None)?;
    let req = RouteRequest {
        model: u.model(),
        keys: &u.keys,
        prompt_tokens: u.prompt_tokens,
        session: None,
        affinity_key: None,
        tenant,
        // The client's node serves the whole stream: a continuation is not forwarded.
        forwarded: true,
        exclude: &again.tried,
    };
    let ctx = AttemptCtx {
        attempt: 1,
        class: again.class,
        pd: false,
    };
    let Decided::Route { routed, ticket } = decide(node, &req, ctx).await else {
        return Err(None);
    };
    let endpoint = ticket.endpoint();
    let replica = endpoint.id.clone();
    let send = node
        .client
        .post(format!("{}{}", endpoint.base, again.path))
        .headers(again.headers.clone());
    let send = match ticket.rank() {
        Some(rank) => rank.apply(send, body),
        None => send.body(body.clone()),
    };
    let first_byte = Duration::from_millis(node.cfg.timeouts.stream_first_byte_ms);
    let why = match tokio::time::timeout(first_byte, send.send()).await {
        Ok(Ok(resp)) if resp.status().is_success() => return Ok((resp, ticket, u.keys)),
        Ok(Ok(resp)) if resp.status().is_client_error() => {
            // The continuation itself was refused (an engine without `continue_final_message`,
            // say): not the replica's fault, and no other would take it either.
            tracing::warn!(replica = %replica, status = %resp.status(), "stream continuation refused");
            ticket.failed(&u.keys);
            return Err(None);
        }
        Ok(Ok(resp)) => format!("answered {}", resp.status()),
        Ok(Err(e)) => e.to_string(),
        Err(_) => format!("nothing within {first_byte:?}"),
    };
    tracing::warn!(replica = %replica, error = %why, "stream continuation failed");
    ticket.failed(&u.keys);
    node.request_failed(routed.replica);
    Err(Some(routed.replica))
}
