//! The steps every engine-backed endpoint takes, whatever API it speaks: the fault verdict and
//! in-flight count ([`admit`]), the bounded body read ([`read_body`]), the data-parallel rank
//! ([`pick_rank`]), the hand-over to the driver up to the first token ([`submit`],
//! [`submit_batch`]), the rest of the tokens ([`Started::finish`] or an SSE body, [`stream`])
//! and the `x-kvmesh-*` headers ([`with_headers`]). Each API's handler composes them with its own
//! parsing and shapes, so completions, chat, Anthropic Messages, Responses and the pooling
//! endpoints count, fail and are charged alike.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::Value;
use tokio::sync::mpsc;

use crate::engine_sim::{Output, Request, TokenId};

use super::anthropic;
use super::driver::{Command, Update};
use super::faults::{StreamFault, Verdict};
use super::openai::{ApiError, Usage};
use super::shared::Shared;

/// vLLM's header naming the data-parallel rank a request must run on.
pub const DP_RANK_HEADER: &str = "x-data-parallel-rank";
/// SGLang's body field naming the data-parallel rank.
pub const DP_RANK_FIELD: &str = "data_parallel_rank";
/// Response header: the rank that served the request.
pub const SERVED_RANK_HEADER: &str = "x-kvmesh-dp-rank";
/// Response header: the replica that answered.
pub const REPLICA_HEADER: &str = "x-kvmesh-replica";

/// Whose error shape an endpoint answers in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    /// `{"error": {"message", "type", "param", "code"}}` (OpenAI, vLLM).
    OpenAi,
    /// `{"type": "error", "error": {"type", "message"}}` (Anthropic).
    Anthropic,
}

/// Why a request ends before its answer: the error, and whether the connection closes too (the
/// replica refusing, crashed or its engine gone, as a dying server's would).
#[derive(Debug)]
pub struct Failure {
    /// What to answer.
    pub error: ApiError,
    /// Whether to add `Connection: close`.
    pub close: bool,
}

impl From<ApiError> for Failure {
    fn from(error: ApiError) -> Self {
        Self {
            error,
            close: false,
        }
    }
}

impl Failure {
    /// A 503 that closes the connection.
    pub fn unavailable(message: &str) -> Self {
        Self {
            error: ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "ServiceUnavailableError",
                message,
            ),
            close: true,
        }
    }

    /// The answer, in `dialect`'s error shape.
    pub fn respond(self, dialect: Dialect) -> Response {
        let mut resp = match dialect {
            Dialect::OpenAi => self.error.into_response(),
            Dialect::Anthropic => anthropic::error_response(&self.error),
        };
        if self.close {
            resp.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        resp
    }
}

/// Counts a request in flight until dropped (when the request or its stream ends).
#[derive(Debug)]
pub struct InFlight(Arc<AtomicI64>);

impl InFlight {
    /// Counts one more in `counter`.
    pub fn new(counter: &Arc<AtomicI64>) -> Self {
        counter.fetch_add(1, Ordering::Relaxed);
        Self(counter.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Unix seconds now (0 if the clock is before 1970).
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Applies the fault verdict to one engine request; on `Serve` (after its added latency) the
/// request counts in flight (`/load`) until the returned guard drops.
pub async fn admit(s: &Shared) -> Result<InFlight, Failure> {
    match s.faults.verdict() {
        Verdict::Refuse => {
            return Err(Failure::unavailable(
                "replica is refusing connections (fault injection)",
            ))
        }
        Verdict::Crash => {
            tracing::error!(replica = %s.id, "fault: crashing");
            if s.exit_on_crash {
                std::process::exit(70);
            }
            let _ = s.stop.send(true);
            return Err(Failure::unavailable("replica crashed (fault injection)"));
        }
        Verdict::Hang => std::future::pending::<()>().await,
        Verdict::Error => {
            return Err(ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "InternalServerError",
                "injected failure (fault injection)",
            )
            .into())
        }
        Verdict::Serve { delay } => {
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
        }
    }
    Ok(InFlight::new(&s.in_flight))
}

/// Reads a JSON body of at most `max_body_bytes` (413 past it, 400 if it is no JSON).
pub async fn read_body(s: &Shared, headers: &HeaderMap, body: Body) -> Result<Value, ApiError> {
    let too_large = || {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "RequestEntityTooLarge",
            format!("request body exceeds {} bytes", s.max_body_bytes),
        )
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|n| n > s.max_body_bytes) {
        return Err(too_large());
    }
    let bytes = axum::body::to_bytes(body, s.max_body_bytes)
        .await
        .map_err(|e| {
            let over_limit = std::error::Error::source(&e)
                .is_some_and(|src| src.is::<http_body_util::LengthLimitError>())
                || e.to_string().contains("length limit");
            if over_limit {
                too_large()
            } else {
                ApiError::bad_request(format!("could not read the request body: {e}"), None)
            }
        })?;
    serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}"), None))
}

/// The rank a request names (header first, then body field), if any; an unparsable or
/// out-of-range rank is a client error, as in vLLM.
fn named_rank(s: &Shared, headers: &HeaderMap, body: &Value) -> Result<Option<usize>, ApiError> {
    let ranks = s.drivers.len();
    let bad = || {
        ApiError::bad_request(
            format!("the data-parallel rank must be an integer in 0..{ranks}"),
            Some(DP_RANK_FIELD),
        )
    };
    let named = if let Some(v) = headers.get(DP_RANK_HEADER) {
        let r = v.to_str().ok().and_then(|v| v.trim().parse::<usize>().ok());
        Some(r.ok_or_else(bad)?)
    } else {
        match body.get(DP_RANK_FIELD) {
            None | Some(Value::Null) => None,
            Some(v) => Some(
                v.as_u64()
                    .and_then(|r| usize::try_from(r).ok())
                    .ok_or_else(bad)?,
            ),
        }
    };
    match named {
        Some(r) if r >= ranks => Err(bad()),
        other => Ok(other),
    }
}

/// The engine's own balancer: the rank with the fewest requests in flight, round-robin among
/// equals (vLLM's internal DP balancer also goes by queue lengths, not by cached prefixes).
fn balanced_rank(s: &Shared) -> usize {
    let n = s.rank_in_flight.len().max(1);
    let start = s.next_rank.fetch_add(1, Ordering::Relaxed) % n;
    (0..n)
        .map(|k| (start + k) % n)
        .min_by_key(|r| {
            s.rank_in_flight
                .get(*r)
                .map_or(i64::MAX, |c| c.load(Ordering::Relaxed))
        })
        .unwrap_or(0)
}

/// The rank to run on: the one the request names, else the balancer's.
pub fn pick_rank(s: &Shared, headers: &HeaderMap, body: &Value) -> Result<usize, ApiError> {
    Ok(named_rank(s, headers, body)?.unwrap_or_else(|| balanced_rank(s)))
}

/// A request past the steps every engine request takes first.
#[derive(Debug)]
pub struct Admitted<T> {
    /// When it arrived (the time to first token counts from here).
    pub arrived: Instant,
    /// Its in-flight count.
    pub in_flight: InFlight,
    /// What the API's parser made of its body.
    pub parsed: T,
    /// The data-parallel rank it runs on.
    pub rank: usize,
    /// The KV-fetch hint its body carries, if any (`kv_fetch.rs`).
    pub fetch: Option<crate::core::kv_hint::FetchHint>,
}

/// The first steps of an engine request: fault verdict and in-flight count ([`admit`]), the
/// body ([`read_body`]), the API's own `parse`, the rank ([`pick_rank`]).
pub async fn begin<T>(
    s: &Shared,
    headers: &HeaderMap,
    body: Body,
    parse: impl FnOnce(&Value) -> Result<T, ApiError>,
) -> Result<Admitted<T>, Failure> {
    let arrived = Instant::now();
    let in_flight = admit(s).await?;
    let body = read_body(s, headers, body).await?;
    let parsed = parse(&body)?;
    let rank = pick_rank(s, headers, &body)?;
    let fetch = super::kv_fetch::hint_of(s, &body);
    Ok(Admitted {
        arrived,
        in_flight,
        parsed,
        rank,
        fetch,
    })
}

/// One prompt for the engine.
#[derive(Debug, Clone)]
pub struct Job {
    /// Prompt tokens.
    pub prompt: Vec<TokenId>,
    /// Tokens to generate (≥ 1).
    pub max_tokens: u32,
    /// Its KV came from a prefill replica (`pd.rs`).
    pub handed_over: bool,
    /// The request field an engine refusal (empty or too long a prompt) names.
    pub param: &'static str,
    /// vLLM's `cache_salt` (completions and chat).
    pub cache_salt: Option<String>,
    /// A KV-fetch hint: pull its blocks from the named replica first (`kv_fetch.rs`).
    pub fetch: Option<crate::core::kv_hint::FetchHint>,
}

/// What the engine charged a request: the `x-kvmesh-*` headers and the usage fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Charge {
    /// Prompt tokens served from the prefix cache (or loaded from the CPU tier).
    pub cached: usize,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// The data-parallel rank that ran it.
    pub rank: usize,
    /// Of `cached`, the tokens pulled from another replica on a fetch hint.
    pub fetched: usize,
}

/// A request whose first token exists: its remaining outputs, its charge and its in-flight
/// counts (released when it is finished, its stream ends or it is dropped).
#[derive(Debug)]
pub struct Started {
    /// The rest of the engine's outputs; dropping it cancels the request at its next output.
    pub rx: mpsc::UnboundedReceiver<Update>,
    /// The engine request id (the `<n>` of answer ids).
    pub engine_id: u64,
    /// What it was charged.
    pub charge: Charge,
    guards: (InFlight, InFlight),
}

impl Started {
    /// Waits for the last token; returns how many were generated and counts the success.
    pub async fn finish(mut self, s: &Shared) -> Result<u32, Failure> {
        let generated = rest_of(&mut self.rx).await?;
        drop(self.guards);
        s.metrics.success.inc();
        Ok(generated)
    }
}

/// Reads a request's outputs after its first token up to `Finished`: the tokens generated.
async fn rest_of(rx: &mut mpsc::UnboundedReceiver<Update>) -> Result<u32, Failure> {
    let mut generated = 1;
    loop {
        match rx.recv().await {
            Some(Ok(Output::Token { .. })) => generated += 1,
            Some(Ok(Output::Finished { .. })) => return Ok(generated),
            Some(_) => {}
            None => return Err(Failure::unavailable("engine stopped mid-request")),
        }
    }
}

/// Sends `job` to `driver`; its id and the receiver of its outputs.
fn send_job(
    s: &Shared,
    driver: &mpsc::UnboundedSender<Command>,
    job: &Job,
    fetched: Option<crate::engine_sim::Fetched>,
) -> Result<(u64, mpsc::UnboundedReceiver<Update>), Failure> {
    let id = s.next_engine_id();
    let (tx, rx) = mpsc::unbounded_channel::<Update>();
    let req = Request {
        id,
        prompt: job.prompt.clone(),
        max_tokens: job.max_tokens,
        cache_salt: job.cache_salt.clone(),
    };
    let cmd = Command::Submit {
        req,
        tx,
        handed_over: job.handed_over,
        fetched,
    };
    driver
        .send(cmd)
        .map_err(|_| Failure::unavailable("engine stopped"))?;
    Ok((id, rx))
}

/// Waits for a request's first token: (cached, prompt, fetched) tokens. A refusal by the engine
/// (empty or too long a prompt) is the client's error, naming `param`.
async fn first_token(
    rx: &mut mpsc::UnboundedReceiver<Update>,
    param: &'static str,
) -> Result<(usize, usize, usize), Failure> {
    match rx.recv().await {
        Some(Ok(Output::FirstToken {
            cached_tokens,
            prompt_tokens,
            fetched_tokens,
            ..
        })) => Ok((cached_tokens, prompt_tokens, fetched_tokens)),
        Some(Ok(other)) => {
            tracing::error!(?other, "first engine output was not a first token");
            Err(Failure::unavailable("engine protocol error"))
        }
        Some(Err(e)) => Err(ApiError::bad_request(e.to_string(), Some(param)).into()),
        None => Err(Failure::unavailable("engine stopped")),
    }
}

/// The driver of `rank` and a count of the request in that rank's load.
fn rank_driver(
    s: &Shared,
    rank: usize,
) -> Result<(&mpsc::UnboundedSender<Command>, InFlight), Failure> {
    match (s.drivers.get(rank), s.rank_in_flight.get(rank)) {
        (Some(driver), Some(load)) => Ok((driver, InFlight::new(load))),
        _ => Err(Failure::unavailable("engine stopped")),
    }
}

/// Hands `job` to `rank`'s engine and waits for its first token (observing the time to it from
/// `arrived`). The client leaving drops the future and so cancels the request.
pub async fn submit(
    s: &Shared,
    rank: usize,
    in_flight: InFlight,
    job: Job,
    arrived: Instant,
) -> Result<Started, Failure> {
    let (driver, rank_in_flight) = rank_driver(s, rank)?;
    // A fetch hint: pull the blocks first (a failed pull recomputes them).
    let fetched = match &job.fetch {
        Some(hint) => super::kv_fetch::pull(s, hint, &job.prompt, job.cache_salt.as_deref()).await,
        None => None,
    };
    let (engine_id, mut rx) = send_job(s, driver, &job, fetched)?;
    let (cached, prompt_tokens, fetched) = first_token(&mut rx, job.param).await?;
    s.metrics.ttft.observe(arrived.elapsed().as_secs_f64());
    s.metrics.kv_fetched_tokens.inc_by(fetched as u64);
    Ok(Started {
        rx,
        engine_id,
        charge: Charge {
            cached,
            prompt_tokens,
            rank,
            fetched,
        },
        guards: (in_flight, rank_in_flight),
    })
}

/// Runs every job of a pooling request to its end on `rank` (all submitted before any is
/// awaited, so the engine batches them): each job's charge and the total. The request counts in
/// flight once, as one request of vLLM's pooling API does.
pub async fn submit_batch(
    s: &Shared,
    rank: usize,
    in_flight: InFlight,
    jobs: &[Job],
    arrived: Instant,
) -> Result<(Vec<Charge>, Charge), Failure> {
    let (driver, rank_in_flight) = rank_driver(s, rank)?;
    let mut pending = Vec::with_capacity(jobs.len());
    for job in jobs {
        pending.push((send_job(s, driver, job, None)?.1, job.param));
    }
    let mut charges = Vec::with_capacity(jobs.len());
    let mut total = Charge {
        rank,
        ..Charge::default()
    };
    for (rx, param) in &mut pending {
        let (cached, prompt_tokens, _) = first_token(rx, param).await?;
        total.cached += cached;
        total.prompt_tokens += prompt_tokens;
        charges.push(Charge {
            cached,
            prompt_tokens,
            rank,
            fetched: 0,
        });
    }
    s.metrics.ttft.observe(arrived.elapsed().as_secs_f64());
    for (rx, _) in &mut pending {
        rest_of(rx).await?;
    }
    drop((in_flight, rank_in_flight));
    s.metrics.success.inc();
    Ok((charges, total))
}

/// Adds the headers every engine answer carries: replica, cached and prompt tokens, rank.
pub fn with_headers(mut resp: Response, replica: &str, charge: Charge) -> Response {
    let h = resp.headers_mut();
    for (name, value) in [
        (REPLICA_HEADER, replica.to_owned()),
        ("x-kvmesh-cached-tokens", charge.cached.to_string()),
        ("x-kvmesh-prompt-tokens", charge.prompt_tokens.to_string()),
        ("x-kvmesh-fetched-tokens", charge.fetched.to_string()),
        (SERVED_RANK_HEADER, charge.rank.to_string()),
    ] {
        if let Ok(v) = HeaderValue::from_str(&value) {
            h.insert(name, v);
        }
    }
    resp
}

/// Adds `x-kvmesh-replica` alone: to answers the front gives without the engine.
pub fn with_replica_header(mut resp: Response, replica: &str) -> Response {
    if let Ok(v) = HeaderValue::from_str(replica) {
        resp.headers_mut().insert(REPLICA_HEADER, v);
    }
    resp
}

/// How one API writes a streamed answer: the SSE events around the generated tokens.
pub trait SseShape: Send + 'static {
    /// The events up to and including the first token's (`last`: it is also the last token).
    fn opening(&mut self, last: bool) -> Vec<String>;
    /// The event of generated token `i` (0-based, so ≥ 1 here).
    fn token(&mut self, i: u32, last: bool) -> String;
    /// The events after the last token, given the request's final usage.
    fn closing(&mut self, usage: Usage) -> Vec<String>;
}

/// Streams `started`'s tokens as `shape` writes them (`text/event-stream`). A client that leaves
/// ends the task, which drops the receiver and so cancels the request; an engine that stops ends
/// the body without its closing events, as a dying server would.
pub fn stream(
    s: Arc<Shared>,
    started: Started,
    max_tokens: u32,
    mut shape: impl SseShape,
) -> Response {
    let (body_tx, body_rx) = mpsc::channel::<std::io::Result<Bytes>>(64);
    let Started {
        mut rx,
        charge,
        guards,
        ..
    } = started;
    tokio::spawn(async move {
        let _guards = guards;
        let send = |events: Vec<String>, sent: u32| {
            let body_tx = body_tx.clone();
            let s = Arc::clone(&s);
            async move {
                for e in events {
                    if body_tx.send(Ok(Bytes::from(e))).await.is_err() {
                        return false;
                    }
                }
                match s.faults.stream_fault(sent) {
                    StreamFault::Continue => true,
                    StreamFault::Stall => {
                        tracing::warn!(replica = %s.id, "fault: stream stalled");
                        // Hung until the client leaves.
                        body_tx.closed().await;
                        false
                    }
                    StreamFault::Cut => {
                        tracing::warn!(replica = %s.id, "fault: stream cut");
                        let cut = std::io::Error::other("stream cut (fault injection)");
                        let _ = body_tx.send(Err(cut)).await;
                        false
                    }
                }
            }
        };
        // The first token already arrived.
        let mut generated = 1u32;
        if !send(shape.opening(max_tokens == 1), generated).await {
            return;
        }
        loop {
            match rx.recv().await {
                Some(Ok(Output::Token { .. })) => {
                    generated += 1;
                    let event = shape.token(generated - 1, generated >= max_tokens);
                    if !send(vec![event], generated).await {
                        return;
                    }
                }
                Some(Ok(Output::Finished { .. })) => break,
                Some(_) => {}
                None => return,
            }
        }
        s.metrics.success.inc();
        let usage = Usage {
            prompt: charge.prompt_tokens,
            cached: charge.cached,
            completion: generated,
        };
        send(shape.closing(usage), 0).await;
    });
    let body =
        futures::stream::unfold(
            body_rx,
            |mut rx| async move { rx.recv().await.map(|b| (b, rx)) },
        );
    let mut resp = Body::from_stream(body).into_response();
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    resp
}
