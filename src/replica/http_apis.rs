//! The replica's routes beyond OpenAI completions and chat, as vLLM ≥ 0.11 serves them: Anthropic
//! Messages (`/v1/messages`, `/v1/messages/count_tokens`), OpenAI Responses (`/v1/responses`,
//! `GET /v1/responses/{id}`, `/v1/responses/{id}/cancel`) and the pooling endpoints
//! (`/v1/embeddings`, `/rerank`, `/v1/rerank`, `/v2/rerank`, `/score`, `/v1/score`).
//!
//! Each handler is the shared steps of `engine_call.rs` (faults, in-flight count, body, rank,
//! engine, `x-kvmesh-*` headers) around its API's pure shapes (`anthropic.rs`, `responses.rs`,
//! `pooling.rs`), so these requests queue, load the engine, hit its prefix cache and fail exactly
//! as completions do. The answers the front gives without the engine (`count_tokens`, reading or
//! cancelling a stored response) take no fault and carry only `x-kvmesh-replica`.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::Value;

use crate::engine_sim::tokenize;

use super::anthropic::{self, Reply};
use super::engine_call::{
    self as call, begin, read_body, submit, submit_batch, with_headers, with_replica_header,
    Charge, Dialect, Failure, Job, SseShape,
};
use super::openai::{filler_text, Usage};
use super::pooling::{self, Pool};
use super::responses::{self, Draft};
use super::shared::Shared;

/// The routes of this file, to merge into the replica's router.
pub fn routes() -> Router<Arc<Shared>> {
    Router::new()
        .route("/v1/messages", post(messages))
        .route("/v1/messages/count_tokens", post(count_tokens))
        .route("/v1/responses", post(create_response))
        .route("/v1/responses/{id}", get(get_response))
        .route("/v1/responses/{id}/cancel", post(cancel_response))
        .route("/v1/embeddings", post(embeddings))
        .route("/rerank", post(rerank))
        .route("/v1/rerank", post(rerank))
        .route("/v2/rerank", post(rerank))
        .route("/score", post(score))
        .route("/v1/score", post(score))
}

fn usage(charge: Charge, completion: u32) -> Usage {
    Usage {
        prompt: charge.prompt_tokens,
        cached: charge.cached,
        completion,
    }
}

async fn messages(State(s): State<Arc<Shared>>, headers: HeaderMap, body: Body) -> Response {
    serve_messages(&s, &headers, body)
        .await
        .unwrap_or_else(|f| f.respond(Dialect::Anthropic))
}

/// `POST /v1/messages`.
async fn serve_messages(
    s: &Arc<Shared>,
    headers: &HeaderMap,
    body: Body,
) -> Result<Response, Failure> {
    let a = begin(s, headers, body, anthropic::parse).await?;
    let req = a.parsed;
    let job = Job {
        prompt: tokenize(&req.prompt),
        max_tokens: req.max_tokens,
        handed_over: false,
        param: "messages",
        cache_salt: None,
        fetch: a.fetch,
    };
    let started = submit(s, a.rank, a.in_flight, job, a.arrived).await?;
    let charge = started.charge;
    let reply = Reply::new(&s.id, started.engine_id, &s.model, req.tool);
    let resp = if req.stream {
        call::stream(
            s.clone(),
            started,
            req.max_tokens,
            MessagesSse { reply, charge },
        )
    } else {
        let generated = started.finish(s).await?;
        Json(reply.full(usage(charge, generated))).into_response()
    };
    Ok(with_headers(resp, &s.id, charge))
}

/// Anthropic's event stream.
struct MessagesSse {
    reply: Reply,
    charge: Charge,
}

impl SseShape for MessagesSse {
    fn opening(&mut self, _last: bool) -> Vec<String> {
        self.reply.opening(usage(self.charge, 1))
    }

    fn token(&mut self, i: u32, _last: bool) -> String {
        self.reply.text_delta(i)
    }

    fn closing(&mut self, usage: Usage) -> Vec<String> {
        self.reply.closing(usage)
    }
}

/// `POST /v1/messages/count_tokens`: answered by the front, like `/tokenize`.
async fn count_tokens(State(s): State<Arc<Shared>>, headers: HeaderMap, body: Body) -> Response {
    let resp = match read_body(&s, &headers, body)
        .await
        .and_then(|b| anthropic::count_tokens(&b))
    {
        Ok(v) => Json(v).into_response(),
        Err(e) => Failure::from(e).respond(Dialect::Anthropic),
    };
    with_replica_header(resp, &s.id)
}

async fn create_response(State(s): State<Arc<Shared>>, headers: HeaderMap, body: Body) -> Response {
    serve_responses(&s, &headers, body)
        .await
        .unwrap_or_else(|f| f.respond(Dialect::OpenAi))
}

/// `POST /v1/responses`. An unknown `previous_response_id` is a 404 before any engine work: an
/// answer without the earlier turns would be charged a different prompt.
async fn serve_responses(
    s: &Arc<Shared>,
    headers: &HeaderMap,
    body: Body,
) -> Result<Response, Failure> {
    let a = begin(s, headers, body, |b| {
        let req = responses::parse(b, s.default_max_tokens)?;
        let history = match &req.previous_response_id {
            Some(id) => s
                .responses
                .conversation(id)
                .ok_or_else(|| responses::unknown_previous(id))?,
            None => Arc::default(),
        };
        Ok((req, history))
    })
    .await?;
    let (req, history) = a.parsed;
    let (stream, max_tokens) = (req.stream, req.max_tokens);
    let job = Job {
        prompt: tokenize(&responses::prompt_text(&req, &history)),
        max_tokens,
        handed_over: false,
        param: "input",
        cache_salt: None,
        fetch: a.fetch,
    };
    let started = submit(s, a.rank, a.in_flight, job, a.arrived).await?;
    let charge = started.charge;
    let draft = Draft::new(&s.id, started.engine_id, call::unix_now(), &s.model, req);
    let mut turn = Turn {
        s: s.clone(),
        draft,
        history,
        seq: 0,
    };
    let resp = if stream {
        call::stream(s.clone(), started, max_tokens, turn)
    } else {
        let generated = started.finish(s).await?;
        Json(turn.complete(usage(charge, generated))).into_response()
    };
    Ok(with_headers(resp, &s.id, charge))
}

/// One Responses turn being answered.
struct Turn {
    s: Arc<Shared>,
    draft: Draft,
    history: Arc<Vec<Value>>,
    /// The next event's `sequence_number`.
    seq: u64,
}

impl Turn {
    /// The completed response object, stored first (unless `store: false`) so a follow-up sent
    /// as soon as it is read finds it.
    fn complete(&mut self, usage: Usage) -> Value {
        let completed = self.draft.object(Some(usage));
        if self.draft.req.store {
            let text = filler_text(usage.completion);
            let conversation = responses::conversation_after(&self.draft.req, &self.history, &text);
            if !self
                .s
                .responses
                .insert(self.draft.id.clone(), &completed, conversation)
            {
                tracing::debug!(id = %self.draft.id, "response too large to store");
            }
        }
        completed
    }
}

impl SseShape for Turn {
    fn opening(&mut self, _last: bool) -> Vec<String> {
        self.draft.opening(&mut self.seq)
    }

    fn token(&mut self, i: u32, _last: bool) -> String {
        self.draft.delta(&mut self.seq, i)
    }

    fn closing(&mut self, usage: Usage) -> Vec<String> {
        let completed = self.complete(usage);
        let text = filler_text(usage.completion);
        self.draft.closing(&mut self.seq, &completed, &text)
    }
}

/// `GET /v1/responses/{id}`: the stored response object.
async fn get_response(State(s): State<Arc<Shared>>, Path(id): Path<String>) -> Response {
    let resp = match s.responses.response(&id) {
        Some(json) => ([(header::CONTENT_TYPE, "application/json")], json).into_response(),
        None => responses::unknown_response(&id).into_response(),
    };
    with_replica_header(resp, &s.id)
}

/// `POST /v1/responses/{id}/cancel`: nothing to cancel, the replica runs no background
/// responses (400), or no such response (404).
async fn cancel_response(State(s): State<Arc<Shared>>, Path(id): Path<String>) -> Response {
    let e = match s.responses.response(&id) {
        Some(_) => responses::not_cancellable(&id),
        None => responses::unknown_response(&id),
    };
    with_replica_header(e.into_response(), &s.id)
}

async fn embeddings(State(s): State<Arc<Shared>>, headers: HeaderMap, body: Body) -> Response {
    serve_pooling(&s, &headers, body, Pool::Embeddings).await
}

async fn rerank(State(s): State<Arc<Shared>>, headers: HeaderMap, body: Body) -> Response {
    serve_pooling(&s, &headers, body, Pool::Rerank).await
}

async fn score(State(s): State<Arc<Shared>>, headers: HeaderMap, body: Body) -> Response {
    serve_pooling(&s, &headers, body, Pool::Score).await
}

/// A pooling request: every input a one-token prefill on one rank, then the pooled answer.
async fn serve_pooling(s: &Arc<Shared>, headers: &HeaderMap, body: Body, pool: Pool) -> Response {
    let run = async {
        let a = begin(s, headers, body, |b| pooling::parse(pool, b)).await?;
        let jobs: Vec<Job> = a
            .parsed
            .prompts()
            .into_iter()
            .map(|prompt| Job {
                prompt,
                max_tokens: 1,
                handed_over: false,
                param: pool.param(),
                cache_salt: None,
                fetch: None,
            })
            .collect();
        let (charges, total) = submit_batch(s, a.rank, a.in_flight, &jobs, a.arrived).await?;
        let tokens: Vec<usize> = charges.iter().map(|c| c.prompt_tokens).collect();
        let id = s.next_request_id(pool.id_prefix());
        let answer = a.parsed.answer(&id, call::unix_now(), &s.model, &tokens);
        Ok::<_, Failure>(with_headers(Json(answer).into_response(), &s.id, total))
    };
    run.await.unwrap_or_else(|f| f.respond(Dialect::OpenAi))
}
