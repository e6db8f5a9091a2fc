//! A picked request's bookkeeping through the response phase: the bookkeeping the HTTP front
//! does as it relays an answer, done from the response messages the gateway sends.
//!
//! Exists because the picker never sees the upstream request, yet the node's view must stay as
//! true as if it had relayed it: the pick's `Ticket` holds in-flight and queued prefill until
//! the answer ends (or the stream does: a gateway that goes away releases it); the first body
//! chunk of a success is `Ticket::first_byte` with the request's keys (none for an error);
//! the engine's usage and cached tokens are read as the chunks pass (`receipts.rs`); and when
//! the gateway reports that a fallback served (`x-gateway-destination-endpoint-served`), the
//! booking moves there: the pick's unconfirmed overlay keys are dropped and the replica that
//! served is booked instead (`Node::route_to`), and the pick counts as a failed request.

use std::sync::Arc;

use super::super::receipts::Receipt;
use super::ctx::PickerCtx;
use super::pick;
use crate::core::keys::BlockKey;
use crate::node::Ticket;

/// The bookkeeping of one picked request.
pub struct Accounting {
    ctx: PickerCtx,
    /// The booking; `None` once released.
    ticket: Option<Ticket>,
    /// The request's block keys until its first byte (then empty).
    keys: Vec<BlockKey>,
    /// The endpoint picked first (`ip:port`).
    primary: String,
    /// The prompt's tokens, for a booking moved to a fallback.
    prompt_tokens: u64,
    /// The request's tenant, for a booking moved to a fallback.
    tenant: Option<Arc<str>>,
    /// What the engine reports cached, read as a successful answer passes.
    receipt: Option<Receipt>,
    /// The answer's status was a success (2xx); unknown counts as one.
    success: bool,
    /// The gateway reported the endpoint that served.
    served_known: bool,
}

impl Accounting {
    /// The bookkeeping of a request picked at `primary` and booked in `ticket`.
    pub fn new(
        ctx: PickerCtx,
        ticket: Ticket,
        keys: Vec<BlockKey>,
        primary: &str,
        receipt: Receipt,
        (prompt_tokens, tenant): (u64, Option<&str>),
    ) -> Self {
        Accounting {
            ctx,
            ticket: Some(ticket),
            keys,
            primary: primary.to_owned(),
            prompt_tokens,
            tenant: tenant.map(Arc::from),
            receipt: Some(receipt),
            success: true,
            served_known: false,
        }
    }

    /// The gateway reports `endpoint` served: a fallback takes over the booking.
    pub fn served(&mut self, endpoint: &str) {
        if std::mem::replace(&mut self.served_known, true) {
            return;
        }
        let m = &self.ctx.metrics.served;
        if endpoint.trim() == self.primary {
            m.with_label_values(&["pick"]).inc();
            return;
        }
        let node = &self.ctx.node;
        let Some(j) = pick::replica_at(node, endpoint, &self.ctx.cfg.rank_ports) else {
            m.with_label_values(&["unknown"]).inc();
            return;
        };
        let Some(old) = self.ticket.take() else {
            return;
        };
        if j == old.replica() {
            // Another rank of the same replica: the booking stands.
            self.ticket = Some(old);
            m.with_label_values(&["pick"]).inc();
            return;
        }
        m.with_label_values(&["fallback"]).inc();
        let failed = old.replica();
        old.failed(&self.keys);
        node.request_failed(failed);
        self.ticket = node.route_to(j, &self.keys, self.prompt_tokens, self.tenant.as_deref());
    }

    /// The response's status line arrived (`status`, when readable); `end`: no body follows.
    pub fn response_headers(&mut self, status: Option<u16>, end: bool) {
        self.success = status.is_none_or(|s| (200..300).contains(&s));
        if !self.success {
            // An error answer's usage is not what was served.
            self.receipt = None;
        }
        if end {
            self.first_byte();
            self.finish();
        }
    }

    /// A chunk of the response body; `end`: the last one.
    pub fn response_body(&mut self, chunk: &[u8], end: bool) {
        self.first_byte();
        if let Some(r) = &mut self.receipt {
            r.feed(chunk);
        }
        if end {
            self.finish();
        }
    }

    /// The first byte: the replica's prefill is done, and a success cached the request's blocks.
    fn first_byte(&mut self) {
        let keys = std::mem::take(&mut self.keys);
        if let Some(t) = &mut self.ticket {
            t.first_byte(if self.success { &keys } else { &[] });
        }
    }

    /// The answer ended: its receipt counts, and the booking is released.
    pub fn finish(&mut self) {
        if let Some(r) = self.receipt.take() {
            r.finish(&self.ctx.node);
        }
        self.ticket = None;
        self.unreported();
    }

    /// Counts the request as `unreported` if the gateway never said which endpoint served.
    fn unreported(&mut self) {
        if !std::mem::replace(&mut self.served_known, true) {
            self.ctx
                .metrics
                .served
                .with_label_values(&["unreported"])
                .inc();
        }
    }
}

impl Drop for Accounting {
    fn drop(&mut self) {
        self.unreported();
        // A stream that ended early still counts an answer whose usage went by.
        if let Some(r) = self.receipt.take().filter(Receipt::reported) {
            r.finish(&self.ctx.node);
        }
    }
}
