//! The sans-IO routing core: block keys, summaries, cache models, the view and the policies.
//!
//! Nothing here does I/O, spawns a task or reads a clock: time is an argument. The live node, the
//! simulator and the tests all drive this same code, which is what makes a policy's simulated
//! behaviour the behaviour it has in production.
//!
//! Layout:
//! - [`keys`]: chained block keys over routing text or token ids, seeded by a namespace.
//! - [`prompt`]: the canonical routing text of a completions or chat body.
//! - [`summary`]: Bloom-filter summaries with epochs, deltas, snapshots and their wire form.
//! - [`cache_model`]: a replica's block set (exact from events, or LRU from routed requests).
//! - [`view`]: what a node knows — replicas, health, load, summaries, its own overlay.
//! - [`peer_tips`]: the prefixes the region's other nodes just routed, by their last key.
//! - [`cost`]: the predicted-seconds formula; [`kv_load`]: what an offloaded hit saves;
//!   [`kv_fetch`]: what pulling a prefix from another replica costs, [`fetch_plan`]: which
//!   candidate pulls, [`kv_hint`]: the hint's wire forms.
//! - [`dp_rank`]: which data-parallel rank of a replica holds a prefix, and which to name.
//! - [`hot_sketch`], [`hot_prefix`]: which prefixes are hot, and warming them on more replicas.
//! - [`rank_hints`]: the ranks recently routed prefixes went to, for nodes without KV events.
//! - [`policy`]: the policies behind one trait.
//! - [`region_offer`], [`region_choice`]: other regions in aggregate, and which one a
//!   forwarded request goes to; [`remote_prefix`]: a prefix held in another region —
//!   recompute, pull or forward; [`empty_holders`]: offered holders whose pulls come back empty.
//! - [`regions`], [`affinity`], [`tenants`]: where, for whom, and which replica a session prefers;
//!   [`tenant_salt`]: the engine's `cache_salt` of an authenticated tenant.
//! - [`role`]: a replica's part in prefill/decode disaggregation; [`pd`]: the pair choice.
//! - [`hold`]: holding a request while its replica still computes the prompt it rides on;
//!   [`unanswered_claims`]: region peers whose claimed prefills never answer, not held on.
//! - [`priority`], [`admission`]: priority classes, and the fair queue with deadlines where
//!   requests wait when no replica has room.
//! - [`router`]: one decision, from request and view to route, forward or reject.
//! - [`stream_resume`]: what a stream sent, and the request that continues it elsewhere.

pub mod admission;
pub mod affinity;
pub mod cache_model;
pub mod cost;
pub mod dialect;
pub mod dialect_chat;
pub mod dp_rank;
pub mod empty_holders;
pub mod fetch_plan;
pub mod hold;
pub mod hot_prefix;
pub mod hot_sketch;
pub mod keys;
pub mod kv_fetch;
pub mod kv_hint;
pub mod kv_load;
pub mod pd;
pub mod peer_tips;
pub mod policy;
pub mod priority;
pub mod prompt;
pub mod prompt_de;
pub mod quick_price;
pub mod rank_hints;
pub mod region_choice;
pub mod region_offer;
pub mod regions;
pub mod remote_prefix;
pub mod role;
pub mod router;
pub mod stream_resume;
pub mod strike_book;
pub mod summary;
pub mod summary_slices;
pub mod tenant_salt;
pub mod tenants;
pub mod unanswered_claims;
pub mod view;
