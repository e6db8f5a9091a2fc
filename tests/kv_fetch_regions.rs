//! A prefix held in another region, live (issue #37, "across regions"): two mesh nodes on
//! loopback, one per region, each in front of a simulated replica. With `remote_prefix =
//! "weigh"` and a fast link pinned between the regions, a request at region `eu` whose prompt
//! only `us`'s replica holds goes to `eu`'s replica with a pull hint naming `us`'s, and the pull
//! really happens — in the flat layout (each node sees the other's replicas and summaries; when
//! that source is dead the request still succeeds, recomputed) and in the regional one (`eu`
//! sees `us` only through its region offer, which names the holder; an offered holder dying
//! mid-transfer costs a recompute too). An offer naming a replica of another region than its own is refused, and an
//! offered holder at a host outside `mesh.learn_replicas_from` is never sent to a replica, and
//! one whose pulls keep coming back empty is left out.

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use common::{bounded, client, cluster_ca, mesh_addr, sim_replica, wait_for};
use kvmesh::core::keys::BlockKey;
use kvmesh::core::kv_load::{KvHintFormat, KvLoad};
use kvmesh::core::region_choice::foreign_holder;
use kvmesh::core::region_offer::{OfferedHolder, OfferedModel, RegionHead, RegionOffer};
use kvmesh::core::remote_prefix::RemotePrefixMode;
use kvmesh::core::role::PdFacts;
use kvmesh::core::view::{ReplicaInfo, View};
use kvmesh::mesh::region_record::RegionRecord;
use kvmesh::node::config::mesh::LayoutConfig;
use kvmesh::node::config::{DistanceConfig, MeshSection, NodeConfig, ReplicaConfig};
use kvmesh::proxy::{self, RunningNode};
use kvmesh::replica::ReplicaHandle;
use serde_json::json;

const MODEL: &str = "sim-llama-8b";
/// A replica's tokens pulled on hints, served to pulls, and its failed pulls.
const FETCHED: &str = "kvmesh_replica_kv_fetched_tokens_total";
const SERVED: &str = "kvmesh_replica_kv_served_tokens_total";
const FAILURES: &str = "kvmesh_replica_kv_fetch_failures_total";

/// A node of `region` in front of `replica` (id, url, takes vLLM hints), seeded by `seeds`,
/// in `layout`: the regions 5 s apart (a forward never pays) with a 50 GB/s KV link pinned
/// between them.
fn layout_config(
    certs: &Path,
    (name, region): (&str, &str),
    seeds: &[SocketAddr],
    (id, url, hints): (&str, String, bool),
    layout: LayoutConfig,
) -> NodeConfig {
    kvmesh::mesh::certs::issue_in_dir(certs, name).unwrap();
    let mut cfg = NodeConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        debug_headers: true,
        region: region.into(),
        cluster_id: "kv-fetch-regions-test".into(),
        drain_s: 1,
        remote_prefix: RemotePrefixMode::Weigh,
        ..NodeConfig::default()
    };
    cfg.health.interval_ms = 200;
    // The home never marks its replica down in these tests: a dead source stays in the other
    // node's view, so the request is really sent with a hint naming it.
    cfg.health.unhealthy_after = 1_000;
    cfg.scrape.interval_ms = 100;
    cfg.timeouts.first_byte_ms = 10_000;
    cfg.replicas = vec![ReplicaConfig {
        id: Some(id.into()),
        models: vec![MODEL.into()],
        // A slow prefill as the router predicts it: recomputing 8,192 tokens looks like 4 s.
        prefill_tokens_per_s: 2_000.0,
        kv_load: hints.then(|| KvLoad {
            hints: KvHintFormat::VllmEnvelope,
            ..KvLoad::default()
        }),
        ..ReplicaConfig::from_url(url)
    }];
    cfg.mesh = Some(MeshSection {
        node_id: name.into(),
        listen: "127.0.0.1:0".parse().unwrap(),
        seeds: seeds.iter().map(|s| s.to_string()).collect(),
        certs_dir: Some(certs.to_owned()),
        gossip_interval_ms: 100,
        failure_detection_ms: 2_000,
        warmup_timeout_ms: 5_000,
        layout,
        region_interval_ms: 200,
        distance: vec![DistanceConfig {
            a: "eu".into(),
            b: "us".into(),
            ms: 5_000.0,
            kv_gb_per_s: Some(50.0),
            kv_setup_ms: Some(5.0),
        }],
        ..MeshSection::default()
    });
    cfg
}

/// `n` distinct prompt bytes starting with `seed` (a token per 4 bytes).
fn text(seed: &str, n: usize) -> String {
    let mut s = String::new();
    let mut i = 0;
    while s.len() < n {
        s.push_str(&format!("{seed}-{i:06} "));
        i += 1;
    }
    s.truncate(n);
    s
}

/// `prompt`'s block keys, as the nodes here (default `block_bytes`) key it.
fn keys_of(prompt: &str) -> Vec<BlockKey> {
    let mut keys = Vec::new();
    let ns = kvmesh::core::keys::Namespace::new(MODEL, None, None, None);
    let block_bytes = NodeConfig::default().block_bytes;
    kvmesh::core::keys::text_block_keys(ns, prompt.as_bytes(), block_bytes, &mut keys);
    keys
}

/// `(status, replica routed to)` of one completion through `node`.
async fn complete(c: &reqwest::Client, node: SocketAddr, prompt: &str) -> (u16, String) {
    let resp = c
        .post(format!("http://{node}/v1/completions"))
        .json(&json!({"model": MODEL, "prompt": prompt, "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let routed = resp
        .headers()
        .get("x-kvmesh-routed-to")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let _ = resp.bytes().await;
    (status, routed)
}

/// The sum of a replica's `name` samples on its `/metrics`.
async fn metric(c: &reqwest::Client, base: &str, name: &str) -> f64 {
    let text = c
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .filter(|l| l.starts_with(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The `(epoch, seq)` of replica `id`'s summary in `n`'s view.
fn view_version(n: &RunningNode, id: &str) -> Option<(u64, u64)> {
    let core = n.node.lock();
    let i = core.view.index_of(id)?;
    let s = core.view.replica(i)?.summary.as_ref()?;
    Some((s.epoch(), s.seq()))
}

/// The `(epoch, seq)` of the home's own model of replica `id`, if `n` is its home.
fn home_version(n: &RunningNode, id: &str) -> Option<(u64, u64)> {
    let core = n.node.lock();
    let i = core.view.index_of(id)?;
    let rt = &core.replicas[i];
    rt.mesh
        .home
        .then(|| (rt.cache.summary().epoch(), rt.cache.summary().seq()))
}

/// Two regions on loopback in `layout`: `eu`'s node in front of `ra` (takes vLLM hints) and
/// `us`'s in front of `rb` (takes none), `us` seeded by `eu`.
struct TwoRegions {
    c: reqwest::Client,
    /// Holds the cluster CA's directory for the nodes' lifetime.
    _certs: tempfile::TempDir,
    eu: RunningNode,
    us: RunningNode,
    ra: ReplicaHandle,
    rb: ReplicaHandle,
}

impl TwoRegions {
    async fn start(layout: LayoutConfig) -> TwoRegions {
        let c = client();
        let certs = cluster_ca();
        let ra = sim_replica("ra", |_| {}).await;
        let rb = sim_replica("rb", |_| {}).await;
        let eu = proxy::spawn(layout_config(
            certs.path(),
            ("eu1", "eu"),
            &[],
            ("ra", ra.base_url(), true),
            layout,
        ))
        .await
        .unwrap();
        let us = proxy::spawn(layout_config(
            certs.path(),
            ("us1", "us"),
            &[mesh_addr(&eu)],
            ("rb", rb.base_url(), false),
            layout,
        ))
        .await
        .unwrap();
        TwoRegions {
            c,
            _certs: certs,
            eu,
            us,
            ra,
            rb,
        }
    }

    /// Each of `prompts` completed at `us`, by `rb` (its only replica).
    async fn compute_at_us(&self, prompts: &[&str]) {
        for p in prompts {
            assert_eq!(complete(&self.c, self.us.addr, p).await, (200, "rb".into()));
        }
    }

    /// The sum of `ra`'s `name` samples.
    async fn ra_metric(&self, name: &str) -> f64 {
        metric(&self.c, &self.ra.base_url(), name).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_held_in_another_region_is_pulled_to_a_local_replica_and_a_dead_source_costs_a_recompute(
) {
    bounded(90, async {
        let f = TwoRegions::start(LayoutConfig::Flat).await;
        let (c, eu, us) = (&f.c, &f.eu, &f.us);
        wait_for(Duration::from_secs(20), || {
            eu.node.lock().view.index_of("rb").is_some()
                && us.node.lock().view.index_of("ra").is_some()
        })
        .await
        .expect("each node learns the other region's replica");

        // Two 8,192-token prompts computed in `us` (its only replica), seen settled from `eu`.
        let prompts = [text("doc-one", 4 * 8192), text("doc-two", 4 * 8192)];
        f.compute_at_us(&[&prompts[0], &prompts[1]]).await;
        let settled = wait_for(Duration::from_secs(20), || {
            let home = home_version(us, "rb");
            home.is_some_and(|(_, seq)| seq > 0) && view_version(eu, "rb") >= home
        })
        .await;
        assert!(
            settled.is_some(),
            "eu's view catches up with rb's home: {:?} vs {:?}",
            view_version(eu, "rb"),
            home_version(us, "rb")
        );

        // At `eu`: the local replica, pulling from `us`'s (recomputing looks like 4 s, going
        // there 5 s, the pull ~30 ms).
        assert_eq!(complete(c, eu.addr, &prompts[0]).await, (200, "ra".into()));
        let fetched = f.ra_metric(FETCHED).await;
        assert!(
            fetched >= 8_000.0,
            "ra pulled the prefix from rb: {fetched}"
        );
        assert!(metric(c, &f.rb.base_url(), SERVED).await >= 8_000.0);

        // The source dies (its home does not notice in time): the hint still names it, the
        // pull fails, and the request is served by recomputing.
        let TwoRegions {
            c, eu, us, ra, rb, ..
        } = f;
        let rb_url = rb.base_url();
        rb.shutdown().await;
        assert_eq!(complete(&c, eu.addr, &prompts[1]).await, (200, "ra".into()));
        assert_eq!(
            metric(&c, &ra.base_url(), FAILURES).await,
            1.0,
            "the pull from the dead source ({rb_url}) was tried and failed"
        );
        assert_eq!(
            metric(&c, &ra.base_url(), FETCHED).await,
            fetched,
            "nothing more arrived"
        );
        eu.shutdown().await;
        us.shutdown().await;
        ra.shutdown().await;
    })
    .await;
}

/// Regional gossip: `eu` never sees `us`'s replica, only `us`'s region offer. A prompt `us`
/// computed (twice, so its representative offers the prefix) is served at `eu` by `eu`'s
/// replica pulling the prefix from the holder the offer names. Before offers carried holders
/// only a forward was weighed here, and `eu` recomputed. Then the offered holder dies in every
/// pull it serves (`cut_kv_pulls`: it answers completions and scrapes, so its home keeps
/// offering it and `eu`'s hint names it every time — a holder shut down instead was dropped
/// from the next offer, 200 ms later, and the pull was tried in some runs only): a second
/// offered prompt still succeeds at `eu`, recomputed, and exactly that one failed pull is
/// counted. With the replica's recompute fallback removed, ra answers 503 and the node's retry
/// goes to rb: answered by rb, not ra.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_regional_gossip_a_prefix_is_pulled_from_the_holder_the_region_offer_names_and_a_source_dying_mid_transfer_costs_a_recompute(
) {
    bounded(90, async {
        let f = TwoRegions::start(LayoutConfig::Regional).await;
        let (c, eu) = (&f.c, &f.eu);
        wait_for(Duration::from_secs(20), || {
            eu.node.lock().view.remote_regions.contains_key("us")
        })
        .await
        .expect("eu hears us's region offer");

        let prompt = text("doc-one", 4 * 8192);
        let second = text("doc-two", 4 * 8192);
        f.compute_at_us(&[&prompt, &second, &prompt, &second]).await;
        // The depth (blocks) of `p`'s longest prefix eu's view of us's offer says rb holds.
        let offered = |p: &str| {
            let core = eu.node.lock();
            let offer = core.view.remote_regions.get("us")?;
            let (holder, depth) = offer.pull_source(&keys_of(p))?;
            (holder.id == "rb").then_some(depth)
        };
        // Each prompt's own head, not any two heads: the offer names heads at several depths,
        // and the second prompt's may come a region interval after the first's.
        wait_for(Duration::from_secs(30), || {
            offered(&prompt).is_some() && offered(&second).is_some()
        })
        .await
        .expect("us's offer names rb as both prefixes' holder");
        let depth = offered(&prompt).unwrap_or_default();
        assert!(
            eu.node.lock().view.index_of("rb").is_none(),
            "regional gossip: eu does not see rb itself"
        );

        // At `eu`: the local replica, pulling from the named holder (recomputing looks like
        // 4 s, going there 5 s, the pull ~30 ms).
        assert_eq!(complete(c, eu.addr, &prompt).await, (200, "ra".into()));
        let fetched = f.ra_metric(FETCHED).await;
        let offered_tokens = f64::from(depth) * 64.0;
        assert!(
            fetched >= offered_tokens.min(8_000.0) && fetched >= 4_000.0,
            "ra pulled the offered prefix ({depth} blocks) from rb: {fetched}"
        );
        assert!(metric(c, &f.rb.base_url(), SERVED).await >= 4_000.0);
        assert_eq!(f.ra_metric(FAILURES).await, 0.0);

        // The offered holder now dies mid-transfer in every pull; it stays healthy and
        // offered, so eu's hint names it. The pull fails, counted; the request is served by
        // recomputing.
        let cut = c
            .post(format!("{}/admin/faults", f.rb.base_url()))
            .json(&json!({"cut_kv_pulls": true}))
            .send()
            .await
            .unwrap();
        assert_eq!(cut.status().as_u16(), 200);
        assert!(
            offered(&second).is_some(),
            "the offer still names the failing holder for the second prompt"
        );
        assert_eq!(complete(c, eu.addr, &second).await, (200, "ra".into()));
        assert_eq!(
            f.ra_metric(FAILURES).await,
            1.0,
            "the pull from the offered holder dying mid-transfer was tried and failed"
        );
        assert_eq!(f.ra_metric(FETCHED).await, fetched, "nothing more arrived");
        let TwoRegions { eu, us, ra, rb, .. } = f;
        eu.shutdown().await;
        us.shutdown().await;
        ra.shutdown().await;
        rb.shutdown().await;
    })
    .await;
}

/// The trust gap under regional gossip: a certified member of region `us` publishes an offer
/// naming holders for two prefixes, one at a replica's loopback URL (allowed: the mesh listens
/// on loopback) and one at `0.0.0.0` (the same replica, reached by a host outside
/// `mesh.learn_replicas_from`: what a forged record would use to point `eu`'s replicas at an
/// arbitrary host). `eu` pulls the first and never sends the second's URL to its replica: the
/// holder is dropped when the offer is folded in, and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_offered_holder_outside_the_allowed_hosts_is_never_sent_to_a_replica() {
    bounded(90, async {
        let c = client();
        let certs = cluster_ca();
        let ra = sim_replica("ra", |_| {}).await;
        let rb = sim_replica("rb", |_| {}).await;
        let eu_cfg = layout_config(
            certs.path(),
            ("eu1", "eu"),
            &[],
            ("ra", ra.base_url(), true),
            LayoutConfig::Regional,
        );
        let block_bytes = eu_cfg.block_bytes;
        let eu = proxy::spawn(eu_cfg).await.unwrap();
        // rb computes both prompts (straight to the engine: no kvmesh node in us).
        let prompts = [text("doc-one", 4 * 8192), text("doc-two", 4 * 8192)];
        for p in &prompts {
            let r = c
                .post(format!("{}/v1/completions", rb.base_url()))
                .json(&json!({"model": MODEL, "prompt": p, "max_tokens": 1}))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status().as_u16(), 200);
        }
        assert_eq!(block_bytes, NodeConfig::default().block_bytes);
        let head = |p: &str| RegionHead::of(&keys_of(p)).unwrap();
        let (allowed, forged) = (head(&prompts[0]), head(&prompts[1]));
        let forged_url = format!("http://0.0.0.0:{}", rb.addr.port());
        let offer = RegionOffer {
            region: "us".into(),
            models: vec![OfferedModel {
                model: MODEL.into(),
                pool: String::new(),
                whole: true,
                healthy: 1,
                open: 1,
                least_queue_ms: 0,
                prefill_tokens_per_s: 2_000,
            }],
            heads: vec![allowed, forged],
            holders: vec![
                OfferedHolder {
                    head: allowed,
                    id: "rb".into(),
                    url: rb.base_url(),
                    step_ms: 0,
                },
                OfferedHolder {
                    head: forged,
                    id: "rb-forged".into(),
                    url: forged_url.clone(),
                    step_ms: 0,
                },
            ],
        };
        let rogue = common::rogue_member(
            "kv-fetch-regions-test",
            certs.path(),
            "us-rogue",
            "us",
            mesh_addr(&eu),
            2_000,
            |m| {
                m.region_interval = Duration::from_millis(200);
                m.http_url = "https://us-rogue.example:8443".into();
            },
        )
        .await;
        let allowed_named = || {
            eu.node
                .lock()
                .view
                .remote_regions
                .get("us")
                .is_some_and(|o| o.holders.iter().any(|h| h.head == allowed))
        };
        let seen = common::wait_until(Duration::from_secs(30), async || {
            let live: Vec<_> = rogue
                .members()
                .await
                .into_iter()
                .filter(|m| m.live)
                .collect();
            rogue.sync_regions(&live, || offer.clone()).await;
            allowed_named()
        })
        .await;
        assert!(seen.is_some(), "eu folds the rogue's offer in");
        let holder_urls: Vec<String> = eu.node.lock().view.remote_regions["us"]
            .holders
            .iter()
            .map(|h| h.url.clone())
            .collect();
        assert!(
            !holder_urls.contains(&forged_url),
            "the forged holder is dropped: {holder_urls:?}"
        );
        let untrusted = "kvmesh_mesh_records_ignored_total{reason=\"untrusted_holder\"}";
        assert!(metric(&c, &format!("http://{}", eu.addr), untrusted).await >= 1.0);

        // The allowed holder is pulled from (so the offer and its heads are right) ...
        assert_eq!(complete(&c, eu.addr, &prompts[0]).await, (200, "ra".into()));
        let fetched = metric(&c, &ra.base_url(), FETCHED).await;
        assert!(
            fetched >= 4_000.0,
            "ra pulled from the allowed holder: {fetched}"
        );
        // ... the forged one never: no pull tried, nothing more arrived.
        assert_eq!(complete(&c, eu.addr, &prompts[1]).await.0, 200);
        assert_eq!(metric(&c, &ra.base_url(), FAILURES).await, 0.0);
        assert_eq!(
            metric(&c, &ra.base_url(), FETCHED).await,
            fetched,
            "no pull from {forged_url}"
        );
        rogue.shutdown().await;
        eu.shutdown().await;
        ra.shutdown().await;
        rb.shutdown().await;
    })
    .await;
}

/// The trust gap an allowed host leaves: a certified member of region `us` offers a real
/// replica at an allowed URL (`rb`) as the holder of four prefixes `rb` never computed. `eu`'s
/// replica pulls from it, finds nothing and recomputes (the answer still 200). After three
/// such empty pulls within a minute `eu` leaves the holder out (counted,
/// `records_ignored{reason="empty_holder"}`): the fourth offered prompt gets no hint, so the
/// failed pulls stay at three. Without the back-off the holder stays offered and the fourth
/// prompt's pull fails too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_offered_holder_whose_pulls_come_back_empty_is_left_out_after_three() {
    bounded(120, async {
        let c = client();
        let certs = cluster_ca();
        let ra = sim_replica("ra", |_| {}).await;
        let rb = sim_replica("rb", |_| {}).await;
        let eu = proxy::spawn(layout_config(
            certs.path(),
            ("eu1", "eu"),
            &[],
            ("ra", ra.base_url(), true),
            LayoutConfig::Regional,
        ))
        .await
        .unwrap();
        let prompts: Vec<String> = (0..4)
            .map(|i| text(&format!("doc-{i}"), 4 * 8192))
            .collect();
        let heads: Vec<RegionHead> = prompts
            .iter()
            .map(|p| RegionHead::of(&keys_of(p)).unwrap())
            .collect();
        let offer = RegionOffer {
            region: "us".into(),
            models: vec![OfferedModel {
                model: MODEL.into(),
                pool: String::new(),
                whole: true,
                healthy: 1,
                open: 1,
                least_queue_ms: 0,
                prefill_tokens_per_s: 2_000,
            }],
            heads: heads.clone(),
            holders: heads
                .iter()
                .map(|&head| OfferedHolder {
                    head,
                    id: "rb".into(),
                    url: rb.base_url(),
                    step_ms: 0,
                })
                .collect(),
        };
        let rogue = common::rogue_member(
            "kv-fetch-regions-test",
            certs.path(),
            "us-rogue",
            "us",
            mesh_addr(&eu),
            2_000,
            |m| {
                m.region_interval = Duration::from_millis(200);
                m.http_url = "https://us-rogue.example:8443".into();
            },
        )
        .await;
        // The rogue's round: publish the offer again (a representative's record is refreshed
        // each round, or it ages out).
        let publish = || async {
            let live: Vec<_> = rogue
                .members()
                .await
                .into_iter()
                .filter(|m| m.live)
                .collect();
            rogue.sync_regions(&live, || offer.clone()).await;
        };
        let offered_holders = || {
            eu.node
                .lock()
                .view
                .remote_regions
                .get("us")
                .map_or(0, |o| o.holders.len())
        };
        let seen = common::wait_until(Duration::from_secs(30), async || {
            publish().await;
            offered_holders() == 4
        })
        .await;
        assert!(seen.is_some(), "eu folds the rogue's four holders in");

        // Three offered prompts: each pulled from rb, which holds nothing; each recomputed.
        for (i, p) in prompts[..3].iter().enumerate() {
            publish().await;
            assert_eq!(complete(&c, eu.addr, p).await, (200, "ra".into()));
            assert_eq!(
                metric(&c, &ra.base_url(), FAILURES).await,
                (i + 1) as f64,
                "pull {} from the empty holder was tried and failed",
                i + 1
            );
        }
        // The third empty pull leaves rb out, while the rogue keeps offering it.
        let empty = "kvmesh_mesh_records_ignored_total{reason=\"empty_holder\"}";
        let node_url = format!("http://{}", eu.addr);
        let left_out = common::wait_until(Duration::from_secs(20), async || {
            publish().await;
            offered_holders() == 0 && metric(&c, &node_url, empty).await >= 1.0
        })
        .await;
        assert!(
            left_out.is_some(),
            "rb is left out after three empty pulls: {} holders offered, {empty} = {}",
            offered_holders(),
            metric(&c, &node_url, empty).await
        );
        // The fourth offered prompt: no hint, no pull, served by recomputing.
        publish().await;
        assert_eq!(complete(&c, eu.addr, &prompts[3]).await, (200, "ra".into()));
        assert_eq!(
            metric(&c, &ra.base_url(), FAILURES).await,
            3.0,
            "no pull from the holder left out"
        );
        assert_eq!(metric(&c, &ra.base_url(), FETCHED).await, 0.0);
        rogue.shutdown().await;
        eu.shutdown().await;
        ra.shutdown().await;
        rb.shutdown().await;
    })
    .await;
}

/// The offer's wire form carries the holder; a reader refuses an offer that names a replica
/// it knows in another region (here its own), and keeps one naming a replica it does not know.
#[test]
fn an_offer_naming_another_regions_replica_is_refused() {
    let keys: Vec<BlockKey> = (1..=64).map(BlockKey).collect();
    let head = RegionHead::of(&keys).unwrap();
    let offer = |id: &str, url: &str| RegionOffer {
        region: "us".into(),
        heads: vec![head],
        holders: vec![OfferedHolder {
            head,
            id: id.into(),
            url: url.into(),
            step_ms: 0,
        }],
        ..RegionOffer::default()
    };
    let mut eu = View::new("eu", 64);
    eu.upsert(ReplicaInfo {
        id: "ra".into(),
        url: "http://127.0.0.1:9101".into(),
        region: "eu".into(),
        zone: String::new(),
        pool: String::new(),
        models: vec![MODEL.into()],
        capacity_tokens: 450_000,
        prefill_tokens_per_s: 50_000.0,
        prefill_attention_ms_per_pair: 0.0,
        max_in_flight: 256,
        pd: PdFacts::default(),
        kv_load: None,
    });
    let read = |o: &RegionOffer| {
        let wire = RegionRecord::new(o, 1, vec![]).encode_fit().unwrap();
        RegionRecord::decode(&wire).unwrap().offer()
    };
    let own = read(&offer("rb", "http://127.0.0.1:9102"));
    assert_eq!(
        own.pull_source(&keys).map(|(h, _)| h.id.as_str()),
        Some("rb")
    );
    assert!(foreign_holder(&eu, &own).is_none());
    for (id, url) in [
        ("ra", "http://127.0.0.1:9102"),
        ("rb", "http://127.0.0.1:9101/"),
    ] {
        let foreign = read(&offer(id, url));
        assert!(foreign_holder(&eu, &foreign).is_some(), "{id} at {url}");
    }
}
