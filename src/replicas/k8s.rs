//! Replicas from Kubernetes: the EndpointSlices of a Service (or of a label selector), listed
//! and then watched through the API server.
//!
//! Exists because DNS only tells a router what the cluster DNS cached, up to a TTL late, and
//! nothing about readiness or termination: the EndpointSlice API says within a watch round trip
//! which pods are ready, and which are terminating and must stop getting new requests. Each
//! `[[kubernetes]]` source keeps the slices it was shown (LIST, then WATCH from the list's
//! `resourceVersion`; `410 Gone` or an `ERROR` event with code 410 re-lists) and brings the
//! node's registry in line through the [`ReplicaRegistry`] the node implements, exactly as a DNS
//! source does: an endpoint that becomes routable is registered (or brought back), one that
//! leaves, turns not-ready or starts terminating is removed, so it drains (in-flight requests
//! finish, new ones go elsewhere). An API server that fails or goes away changes nothing: the
//! last set stays until the API answers again (reconnecting with jittered, doubling backoff).
//!
//! The API client (bounded LIST and WATCH, backoff, 410 re-lists) is `k8s_api.rs`, shared with
//! the InferencePool source (`inference_pool.rs`), which a `[[kubernetes]]` table with
//! `inference_pool` selects: [`K8sSource`] drives either. At most `max_endpoints` endpoints and
//! as many slices per source; malformed events, slices and endpoints are dropped and counted in
//! `kvmesh_k8s_dropped_total{source,reason}`, with one warning per 10 s, never a panic.
//!
//! Which endpoints count (the `discovery.k8s.io/v1` API reference): `conditions.ready` unset
//! means ready; `terminating` unset means not terminating. An endpoint is routable when it is
//! ready and not terminating. A terminating endpoint that is still `serving` finishes what it
//! has, which is what draining gives it; it gets nothing new. Only the first address is used
//! (the API says addresses are fungible; the EndpointSlice controller writes one). Slices of
//! address type `FQDN` (deprecated, undefined semantics) are skipped.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};

use serde::Deserialize;

use super::dns::ReplicaRegistry;
use super::inference_pool::PoolFollow;
use super::k8s_api::{
    capped, ApiClient, Batch, DropLog, ListWatch, Members, Named, Object, ObjectMeta, WatchEvent,
};
pub use super::k8s_api::{Dropped, K8sError, K8sMetrics};
use super::k8s_config::MAX_NAME_BYTES;
pub use super::k8s_config::{Found, KubernetesConfig};
use super::kv_events::KvEventsSource;

// ---------------------------------------------------------------------------------------------
// The API's shapes (`discovery.k8s.io/v1`). Every field optional: what is missing or mistyped
// makes that slice or endpoint drop, never the stream.

/// An EndpointSlice, as much of it as routing needs.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct EndpointSlice {
    /// Name and resourceVersion.
    #[serde(default)]
    pub metadata: ObjectMeta,
    /// `IPv4`, `IPv6` or `FQDN`.
    #[serde(default, rename = "addressType")]
    pub address_type: Option<String>,
    /// The endpoints (`null` when the slice is empty).
    #[serde(default)]
    pub endpoints: Option<Vec<Endpoint>>,
    /// The ports every endpoint of the slice listens on (`null` when none).
    #[serde(default)]
    pub ports: Option<Vec<EndpointPort>>,
}

/// One endpoint of a slice.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct Endpoint {
    /// Its addresses; the first is used.
    #[serde(default)]
    pub addresses: Option<Vec<String>>,
    /// Ready / serving / terminating.
    #[serde(default)]
    pub conditions: Option<EndpointConditions>,
    /// The object it stands for (a Pod, usually).
    #[serde(default, rename = "targetRef")]
    pub target_ref: Option<ObjectReference>,
    /// Its zone.
    #[serde(default)]
    pub zone: Option<String>,
}

/// An endpoint's conditions; unset means "unknown", read as the API reference says.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct EndpointConditions {
    /// Ready for traffic; unset reads as ready.
    #[serde(default)]
    pub ready: Option<bool>,
    /// Serving, whatever the terminating state; informational here.
    #[serde(default)]
    pub serving: Option<bool>,
    /// Terminating; unset reads as not terminating.
    #[serde(default)]
    pub terminating: Option<bool>,
}

/// A reference to the object behind an endpoint.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct ObjectReference {
    /// `Pod`, usually.
    #[serde(default)]
    pub kind: Option<String>,
    /// The object's name.
    #[serde(default)]
    pub name: Option<String>,
}

/// A port of a slice.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct EndpointPort {
    /// The Service port's name (empty or unset for an unnamed port).
    #[serde(default)]
    pub name: Option<String>,
    /// The port number; unset means "all ports", which routing cannot use.
    #[serde(default)]
    pub port: Option<i64>,
    /// `TCP` (the default), `UDP` or `SCTP`.
    #[serde(default)]
    pub protocol: Option<String>,
}

/// Whether an endpoint with these conditions should get new requests: ready (unset = ready)
/// and not terminating (unset = not). A terminating endpoint, serving or not, only finishes.
pub fn routable(c: Option<&EndpointConditions>) -> bool {
    let Some(c) = c else { return true };
    c.ready != Some(false) && c.terminating != Some(true)
}

/// The slice's port to route to: the one named `port_name` (TCP), or its only port.
fn slice_port(ports: &[EndpointPort], port_name: Option<&str>) -> Option<u16> {
    let tcp = |p: &&EndpointPort| p.protocol.as_deref().is_none_or(|proto| proto == "TCP");
    let port = match port_name {
        Some(name) => ports
            .iter()
            .filter(tcp)
            .find(|p| p.name.as_deref() == Some(name))?,
        None => {
            let mut tcp_ports = ports.iter().filter(tcp);
            let only = tcp_ports.next()?;
            if tcp_ports.next().is_some() {
                return None;
            }
            only
        }
    };
    u16::try_from(port.port?).ok().filter(|&p| p != 0)
}

/// The routable endpoints of one slice, and what was dropped (reason, count).
pub fn slice_endpoints(
    slice: &EndpointSlice,
    port_name: Option<&str>,
) -> (Vec<Found>, Vec<(Dropped, u64)>) {
    let endpoints = slice.endpoints.as_deref().unwrap_or_default();
    if endpoints.is_empty() {
        return (Vec::new(), Vec::new());
    }
    let ip_slice = matches!(slice.address_type.as_deref(), Some("IPv4" | "IPv6"));
    let port = slice_port(slice.ports.as_deref().unwrap_or_default(), port_name);
    let Some(port) = port.filter(|_| ip_slice) else {
        return (Vec::new(), vec![(Dropped::UnusableSlice, 1)]);
    };
    let mut found = Vec::new();
    let mut bad = 0u64;
    for ep in endpoints {
        if !routable(ep.conditions.as_ref()) {
            continue;
        }
        let Some(ip) = ep
            .addresses
            .as_deref()
            .and_then(<[String]>::first)
            .and_then(|a| a.parse::<IpAddr>().ok())
        else {
            bad += 1;
            continue;
        };
        let addr = SocketAddr::new(ip, port);
        let pod = ep
            .target_ref
            .as_ref()
            .filter(|r| r.kind.as_deref().is_none_or(|k| k == "Pod"))
            .and_then(|r| r.name.as_deref())
            .filter(|n| !n.is_empty());
        if pod.is_some_and(|n| n.len() > MAX_NAME_BYTES) {
            bad += 1;
            continue;
        }
        let id = match pod {
            Some(name) => super::k8s_config::pod_replica_id(name, addr),
            None => addr.to_string(),
        };
        let zone = ep
            .zone
            .as_deref()
            .filter(|z| !z.is_empty() && z.len() <= MAX_NAME_BYTES)
            .map(str::to_owned);
        found.push(Found {
            id,
            addr,
            zone,
            port_index: 0,
            ranks: 0,
        });
    }
    let dropped = if bad > 0 {
        vec![(Dropped::BadEndpoint, bad)]
    } else {
        Vec::new()
    };
    (found, dropped)
}

/// The slices a source was shown, by name, reduced to their routable endpoints. At most
/// `max_endpoints` slices.
pub type SliceSet = Named<Vec<Found>>;

impl SliceSet {
    /// The replicas wanted now, by id — one per id (an endpoint in two slices, as during a
    /// controller's rebalancing, counts once), at most `max` in slice-name order — and how many
    /// more there were.
    pub fn desired(&self, max: usize) -> (BTreeMap<String, Found>, usize) {
        capped(self.iter().flat_map(|(_, found)| found), max)
    }
}

impl Object for EndpointSlice {
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
}

// ---------------------------------------------------------------------------------------------
// The source.

/// What a source follows.
enum Follow {
    /// A Service's (or a selector's) EndpointSlices.
    Slices {
        /// The slices' collection.
        watch: Box<ListWatch>,
        /// The slices shown, reduced to their routable endpoints.
        slices: SliceSet,
    },
    /// An InferencePool and its pods.
    Pool(Box<PoolFollow>),
}

/// One configured Kubernetes source: what it follows, and the replicas it registered.
pub struct K8sSource {
    cfg: KubernetesConfig,
    name: String,
    metrics: K8sMetrics,
    follow: Follow,
    /// Registered replicas this source lists now.
    members: Members,
    /// When "more endpoints than max_endpoints" was last warned.
    over_cap: DropLog,
}

impl K8sSource {
    /// A source for `cfg`: resolves the API server, reads the CA bundle for https.
    pub fn new(cfg: KubernetesConfig, metrics: K8sMetrics) -> Result<Self, K8sError> {
        let api = ApiClient::new(&cfg)?;
        let follow = if cfg.inference_pool.is_some() {
            Follow::Pool(Box::new(PoolFollow::new(api, &cfg, metrics.clone())))
        } else {
            let path = format!(
                "apis/discovery.k8s.io/v1/namespaces/{}/endpointslices",
                cfg.namespace
            );
            let watch = Box::new(
                ListWatch::new(
                    api,
                    &cfg,
                    &path,
                    "endpointslices.discovery.k8s.io",
                    metrics.clone(),
                )
                .with_label_selector(cfg.selector()),
            );
            Follow::Slices {
                watch,
                slices: SliceSet::default(),
            }
        };
        Ok(K8sSource {
            name: cfg.source_name(),
            cfg,
            metrics,
            follow,
            members: Members::default(),
            over_cap: DropLog::default(),
        })
    }

    /// The source's name (`<namespace>/<service>`, `<namespace>/inferencepool/<pool>`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The replicas this source lists now that have `kv_events`, with their event sources.
    pub fn kv_events_members(&self) -> Vec<(usize, KvEventsSource)> {
        self.members.kv_events()
    }

    /// The replicas wanted now, and how many over `max_endpoints` were left out.
    fn desired(&self) -> (BTreeMap<String, Found>, usize) {
        match &self.follow {
            Follow::Slices { slices, .. } => slices.desired(self.cfg.max_endpoints),
            Follow::Pool(pool) => pool.desired(self.cfg.max_endpoints),
        }
    }

    /// Brings the registry in line with what the source was shown: registers routable
    /// endpoints it does not list yet (or brings them back), removes (drains) the ones it
    /// listed that left. Returns the replicas new to the node and whether anything changed.
    pub fn reconcile(&mut self, registry: &dyn ReplicaRegistry) -> (Vec<usize>, bool) {
        let (desired, over) = self.desired();
        if over > 0 && self.over_cap.warn_due() {
            tracing::warn!(source = %self.name, over, max_endpoints = self.cfg.max_endpoints, "more endpoints than max_endpoints: the rest are ignored");
        }
        self.members
            .reconcile(&self.cfg, &self.name, &desired, registry, &self.metrics)
    }

    /// Lists once and brings the registry in line (the node does this before serving). Returns
    /// the replicas new to the node; on error the set is kept and the error logged.
    pub async fn initial_sync(&mut self, registry: &dyn ReplicaRegistry) -> Vec<usize> {
        let listed = match &mut self.follow {
            Follow::Slices { watch, slices } => match watch.list::<EndpointSlice>().await {
                Ok(items) => {
                    apply_slices(watch, slices, &self.cfg, Batch::Listed(items));
                    Ok(())
                }
                Err(e) => Err(e),
            },
            Follow::Pool(pool) => pool.initial_list().await,
        };
        match listed {
            Ok(()) => self.reconcile(registry).0,
            Err(e) => {
                tracing::warn!(source = %self.name, error = %e, "Kubernetes LIST failed; retrying in the background");
                Vec::new()
            }
        }
    }

    /// Lists, watches and reconnects until the registry changed; returns the replicas new to
    /// the node (possibly none: some drained). Never returns on API errors — it backs off and
    /// retries, keeping the set — so the caller races it against its stop signal. The open
    /// watches stay in the source between calls: no event is lost while the caller works.
    pub async fn next_change(&mut self, registry: &dyn ReplicaRegistry) -> Vec<usize> {
        loop {
            let touched = match &mut self.follow {
                Follow::Slices { watch, slices } => {
                    let batch = watch.next::<EndpointSlice>().await;
                    apply_slices(watch, slices, &self.cfg, batch)
                }
                Follow::Pool(pool) => pool.next().await,
            };
            if touched {
                let (added, changed) = self.reconcile(registry);
                if changed {
                    return added;
                }
            }
        }
    }
}

/// Applies a LIST (replacing the set) or watch changes to `slices`; true if any slice changed.
fn apply_slices(
    watch: &mut ListWatch,
    slices: &mut SliceSet,
    cfg: &KubernetesConfig,
    batch: Batch<EndpointSlice>,
) -> bool {
    match batch {
        Batch::Listed(items) => {
            // The list is whole: only now is the old set replaced.
            slices.clear();
            for slice in &items {
                apply_slice(watch, slices, cfg, slice);
            }
        }
        Batch::Changes(events) => {
            for event in events {
                match event {
                    WatchEvent::Applied(slice) => {
                        apply_slice(watch, slices, cfg, &slice);
                    }
                    WatchEvent::Deleted(slice) => match slice.metadata.name.as_deref() {
                        Some(name) => slices.remove(name),
                        None => watch.count_dropped(Dropped::BadSlice, 1),
                    },
                    _ => {}
                }
            }
        }
    }
    true
}

/// Applies one slice as it is now; false if it was refused (over the cap, or nameless).
fn apply_slice(
    watch: &mut ListWatch,
    slices: &mut SliceSet,
    cfg: &KubernetesConfig,
    slice: &EndpointSlice,
) -> bool {
    let Some(name) = slice.metadata.name.clone().filter(|n| !n.is_empty()) else {
        watch.count_dropped(Dropped::BadSlice, 1);
        return false;
    };
    let (found, dropped) = slice_endpoints(slice, cfg.port_name.as_deref());
    for (reason, n) in dropped {
        watch.count_dropped(reason, n);
    }
    if !slices.upsert(name, found, cfg.max_endpoints) {
        watch.count_dropped(Dropped::OverCap, 1);
        return false;
    }
    true
}

/// Decodes one watch line of the EndpointSlice collection.
pub fn parse_event(
    line: &[u8],
) -> Result<WatchEvent<EndpointSlice>, super::k8s_api::MalformedEvent> {
    super::k8s_api::parse_event(line)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replicas::entry::ReplicaConfig;
    use crate::replicas::k8s_api::{api_server_url, Line, LineSplitter};
    use crate::replicas::k8s_config::{DEFAULT_CA_FILE, DEFAULT_TOKEN_FILE};
    use prometheus::Registry;
    use std::path::Path;

    const LIST: &str = include_str!("../../tests/data/k8s-endpointslice-list.json");
    const WATCH: &str = include_str!("../../tests/data/k8s-endpointslice-watch.jsonl");

    fn cfg(toml_text: &str) -> KubernetesConfig {
        toml::from_str(toml_text).unwrap()
    }

    fn list_slices() -> Vec<EndpointSlice> {
        let v: serde_json::Value = serde_json::from_str(LIST).unwrap();
        v["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| serde_json::from_value(i.clone()).unwrap())
            .collect()
    }

    /// The captured list: ready endpoints count, a not-ready and a terminating (still serving)
    /// one do not, a missing `ready` reads as ready, the named port is taken.
    #[test]
    fn a_real_list_gives_ready_non_terminating_endpoints_at_the_named_port() {
        let slices = list_slices();
        let (found, dropped) = slice_endpoints(&slices[0], Some("http"));
        assert!(dropped.is_empty(), "{dropped:?}");
        let ids: Vec<&str> = found.iter().map(|f| f.id.as_str()).collect();
        assert_eq!(
            ids,
            [
                "vllm-7c9d8f6b5-abcde@10.244.1.17:8000",
                "vllm-7c9d8f6b5-hjklm@10.244.3.4:8000"
            ]
        );
        assert_eq!(found[0].zone.as_deref(), Some("us-east-1a"));
        // The only port, without a name asked for; an unnamed one asked for by name is not.
        let (found, _) = slice_endpoints(&slices[1], None);
        assert_eq!(found.len(), 1);
        assert_eq!(
            found[0].id, "[fd00:10:244::5]:8000",
            "no targetRef: the address"
        );
        let (none, dropped) = slice_endpoints(&slices[1], Some("http"));
        assert!(none.is_empty());
        assert_eq!(dropped, vec![(Dropped::UnusableSlice, 1)]);
        // Several ports and none named: ambiguous, skipped.
        let (none, dropped) = slice_endpoints(&slices[0], None);
        assert!(none.is_empty());
        assert_eq!(dropped, vec![(Dropped::UnusableSlice, 1)]);
    }

    #[test]
    fn conditions_read_as_the_api_reference_says() {
        let c = |ready, serving, terminating| EndpointConditions {
            ready,
            serving,
            terminating,
        };
        assert!(routable(None), "no conditions: unknown, ready");
        assert!(routable(Some(&c(None, None, None))));
        assert!(routable(Some(&c(Some(true), Some(true), Some(false)))));
        assert!(!routable(Some(&c(Some(false), Some(false), None))));
        // Terminating but serving (publishNotReadyAddresses may even keep ready true): drains.
        assert!(!routable(Some(&c(Some(false), Some(true), Some(true)))));
        assert!(!routable(Some(&c(Some(true), Some(true), Some(true)))));
    }

    #[test]
    fn bad_endpoints_and_fqdn_slices_are_dropped_and_counted() {
        let slice: EndpointSlice = serde_json::from_str(
            r#"{"metadata":{"name":"s"},"addressType":"IPv4","ports":[{"name":"http","port":8000}],
               "endpoints":[{"addresses":["not-an-ip"]},{"addresses":[]},{},
                            {"addresses":["10.0.0.9"],"targetRef":{"kind":"Pod","name":"p"}}]}"#,
        )
        .unwrap();
        let (found, dropped) = slice_endpoints(&slice, Some("http"));
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].id, "p@10.0.0.9:8000");
        assert_eq!(dropped, vec![(Dropped::BadEndpoint, 3)]);
        let fqdn: EndpointSlice = serde_json::from_str(
            r#"{"metadata":{"name":"f"},"addressType":"FQDN","ports":[{"port":80}],"endpoints":[{"addresses":["a.example"]}]}"#,
        )
        .unwrap();
        assert_eq!(
            slice_endpoints(&fqdn, None),
            (Vec::new(), vec![(Dropped::UnusableSlice, 1)])
        );
        // Port out of range, or "all ports" (unset): unusable.
        for ports in [
            r#"[{"port":70000}]"#,
            r#"[{"name":"http"}]"#,
            r#"[{"port":0}]"#,
        ] {
            let s: EndpointSlice = serde_json::from_str(&format!(
                r#"{{"addressType":"IPv4","ports":{ports},"endpoints":[{{"addresses":["10.0.0.1"]}}]}}"#
            ))
            .unwrap();
            assert!(slice_endpoints(&s, None).0.is_empty(), "{ports}");
        }
        // An empty slice (`endpoints: null`) is fine and drops nothing.
        let empty: EndpointSlice =
            serde_json::from_str(r#"{"addressType":"IPv4","endpoints":null,"ports":null}"#)
                .unwrap();
        assert_eq!(slice_endpoints(&empty, None), (Vec::new(), Vec::new()));
    }

    #[test]
    fn the_desired_set_dedups_across_slices_and_is_capped() {
        let f = |id: &str, port: u16| Found {
            id: id.into(),
            addr: SocketAddr::from(([10, 0, 0, 1], port)),
            zone: None,
            port_index: 0,
            ranks: 0,
        };
        let mut set = SliceSet::default();
        assert!(set.upsert("a".into(), vec![f("x", 1), f("y", 2)], 2));
        assert!(set.upsert("b".into(), vec![f("y", 2), f("z", 3)], 2));
        assert!(!set.upsert("c".into(), vec![f("w", 4)], 2), "slice cap");
        assert!(
            set.upsert("b".into(), vec![f("y", 2), f("z", 3)], 2),
            "update at the cap"
        );
        let (want, over) = set.desired(10);
        assert_eq!(want.keys().collect::<Vec<_>>(), ["x", "y", "z"]);
        assert_eq!(over, 0);
        let (want, over) = set.desired(2);
        assert_eq!(want.len(), 2);
        assert_eq!(over, 1);
        set.remove("a");
        assert_eq!(set.desired(10).0.keys().collect::<Vec<_>>(), ["y", "z"]);
        set.clear();
        assert!(set.is_empty());
    }

    /// The captured watch stream: every line decodes to its event, the 410 to `Expired`.
    #[test]
    fn real_watch_events_decode() {
        let events: Vec<WatchEvent<EndpointSlice>> = WATCH
            .lines()
            .filter(|l| !l.trim().is_empty() && !l.starts_with("//"))
            .map(|l| parse_event(l.as_bytes()).unwrap())
            .collect();
        assert!(
            matches!(&events[0], WatchEvent::Applied(s) if s.metadata.name.as_deref() == Some("vllm-w8n2c")),
            "{events:?}"
        );
        let WatchEvent::Applied(modified) = &events[1] else {
            panic!("{:?}", events[1])
        };
        let (found, _) = slice_endpoints(modified, Some("http"));
        assert_eq!(found.len(), 1, "the terminating endpoint drains");
        assert!(matches!(&events[2], WatchEvent::Bookmark(Some(rv)) if rv == "1300"));
        assert!(
            matches!(&events[3], WatchEvent::Deleted(s) if s.metadata.name.as_deref() == Some("vllm-w8n2c"))
        );
        assert!(matches!(&events[4], WatchEvent::Expired));
        assert!(matches!(&events[5], WatchEvent::Error(_)));
    }

    #[test]
    fn malformed_events_are_errors_not_panics() {
        for line in [
            &b"not json"[..],
            b"{}",
            b"{\"type\":\"ADDED\"}",
            b"{\"type\":\"SURPRISE\",\"object\":{}}",
            b"{\"type\":\"ADDED\",\"object\":{\"endpoints\":\"many\"}}",
            b"{\"type\":\"ERROR\",\"object\":[1]}",
            b"\xff\xfe",
        ] {
            assert!(
                parse_event(line).is_err(),
                "{:?}",
                String::from_utf8_lossy(line)
            );
        }
    }

    #[test]
    fn lines_split_across_chunks_and_overlong_ones_are_skipped() {
        let mut s = LineSplitter::new(8);
        let mut out = Vec::new();
        s.push(b"abc", &mut out);
        assert!(out.is_empty());
        s.push(b"de\n\nfg", &mut out);
        assert_eq!(out, vec![Line::Complete(b"abcde".to_vec())]);
        out.clear();
        // "fg" + 9 more bytes: over 8, reported once, skipped to its newline.
        s.push(b"123456789", &mut out);
        s.push(b"more\nok\n", &mut out);
        assert_eq!(out, vec![Line::Overlong, Line::Complete(b"ok".to_vec())]);
        out.clear();
        s.push(b"12345678\n", &mut out);
        assert_eq!(
            out,
            vec![Line::Complete(b"12345678".to_vec())],
            "exactly max fits"
        );
    }

    #[test]
    fn config_defaults_and_errors_name_the_field() {
        let c = cfg("namespace = \"serving\"\nservice = \"vllm\"\n");
        c.validate().unwrap();
        assert_eq!(c.selector(), "kubernetes.io/service-name=vllm");
        assert_eq!(c.source_name(), "serving/vllm");
        assert_eq!(c.token_file, Path::new(DEFAULT_TOKEN_FILE));
        assert_eq!(c.ca_file, Path::new(DEFAULT_CA_FILE));
        assert_eq!(
            (
                c.request_timeout_ms,
                c.watch_timeout_s,
                c.min_backoff_ms,
                c.max_backoff_ms
            ),
            (10_000, 300, 500, 30_000)
        );
        assert_eq!((c.max_endpoints, c.scheme.as_str()), (4_096, "http"));
        for (text, field) in [
            ("namespace = \"Bad_NS\"\nservice = \"v\"", "namespace"),
            ("namespace = \"n\"", "service"),
            (
                "namespace = \"n\"\nservice = \"v\"\nlabel_selector = \"a=b\"",
                "label_selector",
            ),
            (
                "namespace = \"n\"\nservice = \"v\"\nport_name = \"\"",
                "port_name",
            ),
            (
                "namespace = \"n\"\nservice = \"v\"\napi_server = \"ftp://x\"",
                "api_server",
            ),
            (
                "namespace = \"n\"\nservice = \"v\"\nwatch_timeout_s = 0",
                "watch_timeout_s",
            ),
            (
                "namespace = \"n\"\nservice = \"v\"\nmin_backoff_ms = 10\nmax_backoff_ms = 5",
                "max_backoff_ms",
            ),
            (
                "namespace = \"n\"\nservice = \"v\"\nmax_endpoints = 100000",
                "max_endpoints",
            ),
        ] {
            assert_eq!(cfg(text).validate().unwrap_err().0, field, "{text}");
        }
    }

    #[test]
    fn the_api_server_defaults_to_the_in_cluster_service() {
        let mut c = cfg("namespace = \"n\"\nservice = \"v\"\napi_server = \"http://127.0.0.1:9/\"");
        assert_eq!(api_server_url(&c).unwrap(), "http://127.0.0.1:9");
        c.api_server = None;
        // The environment is the process's: only assert the shape when it is set.
        match api_server_url(&c) {
            Ok(url) => assert!(url.starts_with("https://"), "{url}"),
            Err(e) => assert!(matches!(e, K8sError::NoApiServer)),
        }
    }

    /// An https API server needs a CA bundle with a certificate in it, read at start.
    #[test]
    fn an_https_api_server_trusts_the_ca_file_only_if_it_holds_a_certificate() {
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.crt");
        let cert =
            rcgen::generate_simple_self_signed(vec!["kubernetes.default.svc".into()]).unwrap();
        std::fs::write(&ca, cert.cert.pem()).unwrap();
        let mut c =
            cfg("namespace = \"n\"\nservice = \"v\"\napi_server = \"https://127.0.0.1:6443\"");
        c.ca_file = ca.clone();
        let metrics = K8sMetrics::new(&Registry::new()).unwrap();
        let src = K8sSource::new(c.clone(), metrics.clone()).unwrap();
        let Follow::Slices { watch, .. } = &src.follow else {
            panic!("a service source follows slices")
        };
        assert!(watch.api().send_token, "the token goes over https only");
        std::fs::write(&ca, "not a certificate").unwrap();
        assert!(matches!(
            K8sSource::new(c.clone(), metrics.clone()),
            Err(K8sError::Ca { .. })
        ));
        c.ca_file = dir.path().join("missing.crt");
        assert!(matches!(
            K8sSource::new(c, metrics),
            Err(K8sError::Ca { .. })
        ));
    }

    /// A source's registry diff: new endpoints are added once, departed ones removed once.
    #[test]
    fn reconcile_adds_new_endpoints_and_drains_departed_ones() {
        use std::sync::Mutex;
        #[derive(Default)]
        struct Reg {
            ids: Mutex<Vec<String>>,
            removed: Mutex<Vec<usize>>,
        }
        impl ReplicaRegistry for Reg {
            fn add_replica(&self, spec: &ReplicaConfig) -> anyhow::Result<(usize, bool)> {
                let mut ids = self.ids.lock().unwrap();
                let id = spec.id.clone().unwrap();
                if let Some(i) = ids.iter().position(|x| *x == id) {
                    return Ok((i, false));
                }
                ids.push(id);
                Ok((ids.len() - 1, true))
            }
            fn remove_replica(&self, i: usize) {
                self.removed.lock().unwrap().push(i);
            }
        }
        let metrics = K8sMetrics::new(&Registry::new()).unwrap();
        let c = cfg("namespace = \"n\"\nservice = \"v\"\napi_server = \"http://127.0.0.1:9\"\nport_name = \"http\"\nzone = \"\"");
        let mut src = K8sSource::new(c, metrics).unwrap();
        let reg = Reg::default();
        let Follow::Slices { watch, slices } = &mut src.follow else {
            panic!("a service source follows slices")
        };
        apply_slices(watch, slices, &src.cfg, Batch::Listed(list_slices()));
        let (added, changed) = src.reconcile(&reg);
        assert_eq!((added.clone(), changed), (vec![0, 1], true));
        assert_eq!(src.reconcile(&reg), (Vec::new(), false), "idempotent");
        let spec = src
            .cfg
            .replica(&src.desired().0["vllm-7c9d8f6b5-abcde@10.244.1.17:8000"]);
        assert_eq!(spec.url, "http://10.244.1.17:8000");
        assert_eq!(spec.zone, "us-east-1a", "the endpoint's zone");
        let Follow::Slices { slices, .. } = &mut src.follow else {
            panic!("a service source follows slices")
        };
        slices.remove("vllm-xk2p9");
        assert_eq!(src.reconcile(&reg), (Vec::new(), true));
        let mut removed = reg.removed.lock().unwrap().clone();
        removed.sort();
        assert_eq!(removed, [0, 1]);
    }
}
