//! Replicas from a Gateway API Inference Extension `InferencePool`
//! (`inference.networking.k8s.io/v1`): the ready pods its selector picks, at its target ports.
//!
//! Exists because on Kubernetes of 2026 operators declare the set of model servers as an
//! `InferencePool`, and the endpoint picker a gateway asks is expected to find the pool's pods
//! itself (no Service, no EndpointSlices). A `[[kubernetes]]` table with `inference_pool` follows
//! two collections through the API server, both listed and watched the way the EndpointSlice
//! source does it (`k8s_api::ListWatch`: bounded reads, 410 re-lists, a failed LIST or WATCH
//! keeps the last set):
//!
//! - the pool itself (field selector `metadata.name=<pool>`): its `spec.selector.matchLabels`
//!   becomes the pods' label selector, its `spec.targetPorts` (at most [`MAX_TARGET_PORTS`],
//!   GIE's limit) the ports. A new selector re-lists the pods (the old set stays until that
//!   list arrives); a pool that cannot be used (no labels, no valid port) is dropped and counted,
//!   keeping the last usable one; a deleted (or absent) pool has no pods.
//! - the pods it selects (`api/v1` pods): a pod is routable while its phase is `Running`, its
//!   `Ready` condition `True`, it has a `status.podIP` and no `deletionTimestamp` (terminating
//!   pods drain: their requests finish, they get nothing new).
//!
//! Each routable pod gives one replica per target port, id `<pod>@<ip>:<port>`: several ports
//! are several engines on one pod (GIE's data-parallel ranks as ports), each with its own cache.
//! The engine on the i-th port publishes its KV events on the configured `kv_events` ports + i,
//! as vLLM offsets its publisher by the data-parallel rank (`KubernetesConfig::kv_events_at`).
//! With `target_ports = "ranks"` a pod is one replica at its first port instead, whose
//! data-parallel ranks are the ports (its events: `dp_ranks` = the port count, rank r at + r).
//! At most `max_endpoints` pods and as many replicas are kept; the rest are dropped and counted.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};

use serde::Deserialize;

use super::k8s_api::{
    capped, ApiClient, Batch, Dropped, K8sError, K8sMetrics, ListWatch, Named, Object, ObjectMeta,
    WatchEvent,
};
use super::k8s_config::{Found, KubernetesConfig, TargetPorts, MAX_NAME_BYTES};

/// Most target ports a pool may name (GIE v1: `targetPorts` has at most 8 items).
pub const MAX_TARGET_PORTS: usize = 8;
/// Most labels a pool's selector may hold (GIE v1: `matchLabels` has at most 64).
pub const MAX_SELECTOR_LABELS: usize = 64;
/// Longest label key (a 253-byte prefix, `/`, a 63-byte name) and value (63 bytes).
const MAX_LABEL_KEY_BYTES: usize = 317;
const MAX_LABEL_VALUE_BYTES: usize = 63;

// ---------------------------------------------------------------------------------------------
// The API's shapes. Every field optional: what is missing or mistyped drops that object.

/// An `InferencePool`, as much of it as discovery needs.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct InferencePool {
    /// Name and resourceVersion.
    #[serde(default)]
    pub metadata: ObjectMeta,
    /// Selector and target ports (the endpoint picker reference is the gateway's business).
    #[serde(default)]
    pub spec: Option<PoolSpec>,
}

/// An `InferencePool`'s spec.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct PoolSpec {
    /// Which pods are members.
    #[serde(default)]
    pub selector: Option<PoolSelector>,
    /// The ports the model servers listen on.
    #[serde(default, rename = "targetPorts")]
    pub target_ports: Option<Vec<TargetPort>>,
}

/// A pool's label selector: GIE v1 allows only `matchLabels`.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct PoolSelector {
    /// Label → value, all of which a member pod carries.
    #[serde(default, rename = "matchLabels")]
    pub match_labels: Option<BTreeMap<String, String>>,
}

/// One target port.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct TargetPort {
    /// The port number, 1 to 65,535.
    #[serde(default)]
    pub number: Option<i64>,
}

/// A pod, as much of it as routing needs.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct Pod {
    /// Name, resourceVersion, deletionTimestamp.
    #[serde(default)]
    pub metadata: ObjectMeta,
    /// Phase, address, conditions.
    #[serde(default)]
    pub status: Option<PodStatus>,
}

/// The part of a pod's status used here.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct PodStatus {
    /// `Pending`, `Running`, `Succeeded`, `Failed` or `Unknown`.
    #[serde(default)]
    pub phase: Option<String>,
    /// The pod's (primary) IP address.
    #[serde(default, rename = "podIP")]
    pub pod_ip: Option<String>,
    /// `Ready`, `ContainersReady`, …
    #[serde(default)]
    pub conditions: Option<Vec<PodCondition>>,
}

/// One pod condition.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct PodCondition {
    /// The condition's type (`Ready`).
    #[serde(default, rename = "type")]
    pub kind: Option<String>,
    /// `True`, `False` or `Unknown`.
    #[serde(default)]
    pub status: Option<String>,
}

impl Object for InferencePool {
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
}

impl Object for Pod {
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
}

// ---------------------------------------------------------------------------------------------
// What they mean.

/// What a pool says about its members: the pods' label selector and the ports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolTarget {
    /// `k1=v1,k2=v2` (labels in key order).
    pub selector: String,
    /// The target ports, in the pool's order, without repeats.
    pub ports: Vec<u16>,
}

/// Why a pool cannot be used.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum UnusablePool {
    /// No `spec.selector.matchLabels`, or an empty one (it would select every pod).
    #[error("no spec.selector.matchLabels")]
    NoSelector,
    /// More than [`MAX_SELECTOR_LABELS`] labels, or a key or value that is no label.
    #[error("spec.selector.matchLabels: {0}")]
    BadLabel(String),
    /// No usable `spec.targetPorts` entry, or more than [`MAX_TARGET_PORTS`].
    #[error("spec.targetPorts: {0}")]
    BadPorts(String),
}

/// Whether `s` may be a label value (≤ 63 bytes of `[A-Za-z0-9._-]`, alphanumeric at the ends;
/// empty is allowed) or, with `key`, a label key (`[prefix/]name`).
fn is_label_text(s: &str, key: bool) -> bool {
    let part = |p: &str, max: usize| {
        p.len() <= max
            && p.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
            && p.bytes().next().is_none_or(|b| b.is_ascii_alphanumeric())
            && p.bytes().last().is_none_or(|b| b.is_ascii_alphanumeric())
    };
    if !key {
        return part(s, MAX_LABEL_VALUE_BYTES);
    }
    if s.len() > MAX_LABEL_KEY_BYTES {
        return false;
    }
    let (prefix, name) = match s.split_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, s),
    };
    !name.is_empty()
        && part(name, MAX_LABEL_VALUE_BYTES)
        && prefix.is_none_or(|p| !p.is_empty() && part(p, MAX_NAME_BYTES))
}

impl InferencePool {
    /// The pool's selector and ports, checked.
    pub fn target(&self) -> Result<PoolTarget, UnusablePool> {
        let spec = self.spec.as_ref();
        let labels = spec
            .and_then(|s| s.selector.as_ref())
            .and_then(|s| s.match_labels.as_ref())
            .filter(|l| !l.is_empty())
            .ok_or(UnusablePool::NoSelector)?;
        if labels.len() > MAX_SELECTOR_LABELS {
            return Err(UnusablePool::BadLabel(format!(
                "more than {MAX_SELECTOR_LABELS} labels"
            )));
        }
        let mut selector = String::new();
        for (k, v) in labels {
            if !is_label_text(k, true) || !is_label_text(v, false) {
                return Err(UnusablePool::BadLabel(format!(
                    "{:?}={:?} is not a label",
                    super::k8s_api::truncated(k, 64),
                    super::k8s_api::truncated(v, 64)
                )));
            }
            if !selector.is_empty() {
                selector.push(',');
            }
            selector.push_str(k);
            selector.push('=');
            selector.push_str(v);
        }
        let listed = spec
            .and_then(|s| s.target_ports.as_deref())
            .unwrap_or_default();
        if listed.len() > MAX_TARGET_PORTS {
            return Err(UnusablePool::BadPorts(format!(
                "more than {MAX_TARGET_PORTS} ports"
            )));
        }
        let mut ports = Vec::with_capacity(listed.len());
        for p in listed {
            let port = p
                .number
                .and_then(|n| u16::try_from(n).ok())
                .filter(|&n| n != 0)
                .ok_or_else(|| UnusablePool::BadPorts(format!("{:?} is no port", p.number)))?;
            if !ports.contains(&port) {
                ports.push(port);
            }
        }
        if ports.is_empty() {
            return Err(UnusablePool::BadPorts("no port".into()));
        }
        Ok(PoolTarget { selector, ports })
    }
}

/// A pod as routing sees it: its address while routable, `None` while not (not running, not
/// ready, no IP yet, or terminating).
pub fn routable_ip(pod: &Pod) -> Option<IpAddr> {
    if pod.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let status = pod.status.as_ref()?;
    if status.phase.as_deref() != Some("Running") {
        return None;
    }
    let ready = status
        .conditions
        .as_deref()
        .unwrap_or_default()
        .iter()
        .any(|c| c.kind.as_deref() == Some("Ready") && c.status.as_deref() == Some("True"));
    if !ready {
        return None;
    }
    status.pod_ip.as_deref()?.parse().ok()
}

/// The pods a source was shown, by name: `Some(ip)` while routable. At most `max_endpoints`.
pub type PodSet = Named<Option<IpAddr>>;

impl PodSet {
    /// The replicas wanted now, by id — one per routable pod and port, at most `max` in pod-name
    /// order — and how many more there were.
    pub fn desired(
        &self,
        ports: &[u16],
        as_ranks: bool,
        max: usize,
    ) -> (BTreeMap<String, Found>, usize) {
        // As ranks: one replica at the first port, the rest are its ranks.
        let (ports, ranks) = match ports.split_first() {
            Some((first, _)) if as_ranks => (std::slice::from_ref(first), ports.len() as u16),
            _ => (ports, 0),
        };
        let found: Vec<Found> = self
            .iter()
            .filter_map(|(name, ip)| Some((name, (*ip)?)))
            .flat_map(|(name, ip)| {
                ports.iter().zip(0u16..).map(move |(&port, i)| {
                    let addr = SocketAddr::new(ip, port);
                    Found {
                        id: super::k8s_config::pod_replica_id(name, addr),
                        addr,
                        zone: None,
                        port_index: i,
                        ranks,
                    }
                })
            })
            .collect();
        capped(found.iter(), max)
    }
}

// ---------------------------------------------------------------------------------------------
// The source's two collections.

/// A pool followed: the pool (by name) and, once it names them, its pods.
pub struct PoolFollow {
    /// The pool's name.
    pool: String,
    max_endpoints: usize,
    /// The pool, under `fieldSelector=metadata.name=<pool>`.
    pools: ListWatch,
    /// Its pods, under the pool's selector.
    pods: ListWatch,
    /// What the pool says now; `None` before it was seen, or once it is deleted.
    target: Option<PoolTarget>,
    /// The pods seen under the current selector.
    members: PodSet,
    /// Whether the ports are one replica's ranks (`target_ports = "ranks"`).
    as_ranks: bool,
}

/// What one wait brought.
enum Got {
    Pools(Batch<InferencePool>),
    Pods(Batch<Pod>),
}

impl PoolFollow {
    /// Follows `cfg.inference_pool` in `cfg.namespace` through `api`.
    pub fn new(api: ApiClient, cfg: &KubernetesConfig, metrics: K8sMetrics) -> Self {
        let pool = cfg.inference_pool.clone().unwrap_or_default();
        let ns = &cfg.namespace;
        let pools = ListWatch::new(
            api.clone(),
            cfg,
            &format!("apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools"),
            "inferencepools.inference.networking.k8s.io",
            metrics.clone(),
        )
        .with_field_selector(format!("metadata.name={pool}"));
        let pods = ListWatch::new(
            api,
            cfg,
            &format!("api/v1/namespaces/{ns}/pods"),
            "pods",
            metrics,
        );
        PoolFollow {
            pool,
            max_endpoints: cfg.max_endpoints,
            pools,
            pods,
            target: None,
            members: PodSet::default(),
            as_ranks: cfg.target_ports == Some(TargetPorts::Ranks),
        }
    }

    /// The pool's selector and ports now (`None`: no usable pool seen, or it was deleted).
    pub fn target(&self) -> Option<&PoolTarget> {
        self.target.as_ref()
    }

    /// The replicas wanted now and how many over `max` were left out.
    pub fn desired(&self, max: usize) -> (BTreeMap<String, Found>, usize) {
        match &self.target {
            Some(t) => self.members.desired(&t.ports, self.as_ranks, max),
            None => (BTreeMap::new(), 0),
        }
    }

    /// Lists the pool, then (if it names any) its pods, once: what the node does before it
    /// serves. An error keeps what was known (nothing, at start).
    pub async fn initial_list(&mut self) -> Result<(), K8sError> {
        let pools = self.pools.list::<InferencePool>().await?;
        self.apply_pools(Batch::Listed(pools));
        if self.target.is_some() {
            let pods = self.pods.list::<Pod>().await?;
            self.apply_pods(Batch::Listed(pods));
        }
        Ok(())
    }

    /// Waits for the next change of the pool or its pods and applies it; true if the wanted
    /// replicas may have changed. Never returns on API errors (each collection backs off and
    /// retries, keeping what it had); cancel-safe like `ListWatch::next`.
    pub async fn next(&mut self) -> bool {
        let got = if self.target.is_none() {
            Got::Pools(self.pools.next::<InferencePool>().await)
        } else {
            let (pools, pods) = (&mut self.pools, &mut self.pods);
            tokio::select! {
                b = pools.next::<InferencePool>() => Got::Pools(b),
                b = pods.next::<Pod>() => Got::Pods(b),
            }
        };
        match got {
            Got::Pools(b) => self.apply_pools(b),
            Got::Pods(b) => self.apply_pods(b),
        }
    }

    /// Applies what the pool's collection said; true if the target changed.
    fn apply_pools(&mut self, batch: Batch<InferencePool>) -> bool {
        let before = self.target.clone();
        match batch {
            Batch::Listed(pools) => {
                match pools
                    .iter()
                    .find(|p| p.metadata.name.as_deref() == Some(&self.pool))
                {
                    Some(pool) => self.set_target(pool),
                    None => self.forget_pool(),
                }
            }
            Batch::Changes(events) => {
                for event in events {
                    match event {
                        WatchEvent::Applied(p)
                            if p.metadata.name.as_deref() == Some(&self.pool) =>
                        {
                            self.set_target(&p)
                        }
                        WatchEvent::Deleted(p)
                            if p.metadata.name.as_deref() == Some(&self.pool) =>
                        {
                            self.forget_pool()
                        }
                        // The field selector shows only this pool; anything else is noise.
                        _ => self.pools.count_dropped(Dropped::BadSlice, 1),
                    }
                }
            }
        }
        self.target != before
    }

    /// Takes the pool's selector and ports; an unusable pool keeps the last usable target.
    fn set_target(&mut self, pool: &InferencePool) {
        match pool.target() {
            Ok(target) => {
                if self.target.as_ref().map(|t| &t.selector) != Some(&target.selector) {
                    tracing::info!(pool = %self.pool, selector = %target.selector, ports = ?target.ports, "InferencePool selector: listing its pods");
                    self.pods.set_label_selector(target.selector.clone());
                    self.pods.relist();
                }
                self.target = Some(target);
            }
            Err(e) => {
                tracing::warn!(pool = %self.pool, error = %e, "InferencePool unusable; keeping the last usable selector and ports");
                self.pools.count_dropped(Dropped::UnusableSlice, 1);
            }
        }
    }

    /// The pool is gone: no pods (they drain), no pod watch until it is back.
    fn forget_pool(&mut self) {
        if self.target.is_some() {
            tracing::warn!(pool = %self.pool, "InferencePool not found (deleted?): its pods drain");
        }
        self.target = None;
        self.members.clear();
        self.pods.relist();
    }

    /// Applies what the pods' collection said; true (the set may have changed).
    fn apply_pods(&mut self, batch: Batch<Pod>) -> bool {
        match batch {
            Batch::Listed(pods) => {
                self.members.clear();
                for pod in &pods {
                    self.apply_pod(pod);
                }
            }
            Batch::Changes(events) => {
                for event in events {
                    match event {
                        WatchEvent::Applied(pod) => self.apply_pod(&pod),
                        WatchEvent::Deleted(pod) => match pod.metadata.name.as_deref() {
                            Some(name) => self.members.remove(name),
                            None => self.pods.count_dropped(Dropped::BadSlice, 1),
                        },
                        _ => {}
                    }
                }
            }
        }
        true
    }

    fn apply_pod(&mut self, pod: &Pod) {
        let Some(name) = pod
            .metadata
            .name
            .clone()
            .filter(|n| !n.is_empty() && n.len() <= MAX_NAME_BYTES)
        else {
            self.pods.count_dropped(Dropped::BadSlice, 1);
            return;
        };
        if !self
            .members
            .upsert(name, routable_ip(pod), self.max_endpoints)
        {
            self.pods.count_dropped(Dropped::OverCap, 1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const POOL: &str = include_str!("../../tests/data/k8s-inferencepool.json");
    const PODS: &str = include_str!("../../tests/data/k8s-pod-list.json");

    fn pool() -> InferencePool {
        serde_json::from_str(POOL).unwrap()
    }

    fn pods() -> Vec<Pod> {
        let v: serde_json::Value = serde_json::from_str(PODS).unwrap();
        v["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| serde_json::from_value(i.clone()).unwrap())
            .collect()
    }

    /// The example pool: its labels as a selector in key order, its two ports in its order.
    #[test]
    fn a_pool_gives_its_selector_and_ports() {
        let t = pool().target().unwrap();
        assert_eq!(t.selector, "app=vllm-llama3-8b,kvmesh.dev/pool=llama");
        assert_eq!(t.ports, vec![8000, 8001]);
    }

    #[test]
    fn unusable_pools_say_why() {
        let with = |spec: serde_json::Value| -> Result<PoolTarget, UnusablePool> {
            serde_json::from_value::<InferencePool>(
                serde_json::json!({"metadata":{"name":"p"},"spec":spec}),
            )
            .unwrap()
            .target()
        };
        assert_eq!(
            with(serde_json::json!({"targetPorts":[{"number":8000}]})),
            Err(UnusablePool::NoSelector)
        );
        assert_eq!(
            with(
                serde_json::json!({"selector":{"matchLabels":{}},"targetPorts":[{"number":8000}]})
            ),
            Err(UnusablePool::NoSelector),
            "an empty selector would take every pod"
        );
        for bad in [
            serde_json::json!({"a b": "x"}),
            serde_json::json!({"app": "x,y=z"}),
            serde_json::json!({"app": "-x"}),
            serde_json::json!({"/app": "x"}),
        ] {
            assert!(
                matches!(
                    with(
                        serde_json::json!({"selector":{"matchLabels":bad},"targetPorts":[{"number":8000}]})
                    ),
                    Err(UnusablePool::BadLabel(_))
                ),
                "{bad}"
            );
        }
        let sel = serde_json::json!({"matchLabels":{"app":"v"}});
        for ports in [
            serde_json::json!([]),
            serde_json::json!([{"number":0}]),
            serde_json::json!([{"number":70000}]),
            serde_json::json!([{}]),
            serde_json::json!((1..=9)
                .map(|p| serde_json::json!({"number": 8000 + p}))
                .collect::<Vec<_>>()),
        ] {
            assert!(
                matches!(
                    with(serde_json::json!({"selector":sel,"targetPorts":ports})),
                    Err(UnusablePool::BadPorts(_))
                ),
                "{ports}"
            );
        }
        // Repeated ports count once.
        assert_eq!(
            with(
                serde_json::json!({"selector":sel,"targetPorts":[{"number":8000},{"number":8000}]})
            )
            .unwrap()
            .ports,
            vec![8000]
        );
    }

    /// The example pod list (the API's shape, written by hand): a running ready pod counts; pending, not-ready, terminating and
    /// IP-less pods do not.
    #[test]
    fn only_running_ready_live_pods_with_an_ip_route() {
        let pods = pods();
        let routable: Vec<(String, Option<IpAddr>)> = pods
            .iter()
            .map(|p| (p.metadata.name.clone().unwrap(), routable_ip(p)))
            .collect();
        assert_eq!(
            routable,
            vec![
                (
                    "vllm-llama3-8b-6d5f9c7b8-2xkqz".into(),
                    Some("10.244.1.17".parse().unwrap())
                ),
                ("vllm-llama3-8b-6d5f9c7b8-8mnpq".into(), None),
                ("vllm-llama3-8b-6d5f9c7b8-h4tvw".into(), None),
                ("vllm-llama3-8b-6d5f9c7b8-zr9lk".into(), None),
            ],
            "ready; not ready; terminating; pending without an IP"
        );
    }

    /// Each routable pod gives one replica per port; the i-th port's KV events are at the
    /// configured ports + i; the cap holds.
    #[test]
    fn every_port_of_a_pod_is_a_replica_with_its_own_event_ports() {
        let mut set = PodSet::default();
        let ip: IpAddr = "10.0.0.5".parse().unwrap();
        assert!(set.upsert("p0".into(), Some(ip), 4));
        assert!(set.upsert("p1".into(), None, 4));
        let (want, over) = set.desired(&[8000, 8001], false, 16);
        assert_eq!(over, 0);
        assert_eq!(
            want.keys().collect::<Vec<_>>(),
            ["p0@10.0.0.5:8000", "p0@10.0.0.5:8001"]
        );
        let cfg: KubernetesConfig = toml::from_str(
            "namespace = \"n\"\ninference_pool = \"p\"\nkv_events = { port = 5557, replay_port = 5558 }",
        )
        .unwrap();
        cfg.validate().unwrap();
        let second = &want["p0@10.0.0.5:8001"];
        assert_eq!(second.port_index, 1);
        let kv = cfg.kv_events_at(second).unwrap();
        assert_eq!(kv.endpoint, "tcp://10.0.0.5:5558");
        assert_eq!(kv.replay.as_deref(), Some("tcp://10.0.0.5:5559"));
        assert_eq!(cfg.replica(second).url, "http://10.0.0.5:8001");
        assert_eq!(
            set.desired(&[8000, 8001], false, 1),
            (want.into_iter().take(1).collect(), 1)
        );
        // As ranks: one replica at the first port, its events over both ranks.
        let (ranked, _) = set.desired(&[8000, 8001], true, 16);
        assert_eq!(ranked.keys().collect::<Vec<_>>(), ["p0@10.0.0.5:8000"]);
        let kv = cfg.kv_events_at(&ranked["p0@10.0.0.5:8000"]).unwrap();
        assert_eq!(
            (kv.endpoint.as_str(), kv.dp_ranks),
            ("tcp://10.0.0.5:5557", 2)
        );
        assert!(!set.upsert("p2".into(), Some(ip), 2), "pod cap");
        set.remove("p0");
        assert!(set.desired(&[8000], false, 16).0.is_empty());
    }

    #[test]
    fn pool_config_is_validated_by_name() {
        let cfg = |t: &str| toml::from_str::<KubernetesConfig>(t).unwrap().validate();
        cfg("namespace = \"n\"\ninference_pool = \"vllm-llama3-8b\"").unwrap();
        for (text, field) in [
            (
                "namespace = \"n\"\ninference_pool = \"Bad_Name\"",
                "inference_pool",
            ),
            (
                "namespace = \"n\"\ninference_pool = \"p\"\nservice = \"s\"",
                "inference_pool",
            ),
            (
                "namespace = \"n\"\ninference_pool = \"p\"\nport_name = \"http\"",
                "port_name",
            ),
            (
                "namespace = \"n\"\nservice = \"s\"\ntarget_ports = \"ranks\"",
                "target_ports",
            ),
        ] {
            assert_eq!(cfg(text).unwrap_err().0, field, "{text}");
        }
        let c: KubernetesConfig =
            toml::from_str("namespace = \"n\"\ninference_pool = \"p\"").unwrap();
        assert_eq!(c.source_name(), "n/inferencepool/p");
    }
}
