//! Bytes a node spends on gossip: the byte model of `kvmesh sim` (sans-IO, pure functions).
//!
//! chitchat (0.11.2) runs a round every `interval` in which a node starts `fanout` exchanges
//! with random peers and answers about as many. One exchange is three messages:
//! Syn (the sender's digest: one entry per member), SynAck (the answerer's digest and the delta
//! the sender lacks) and Ack (the delta the answerer lacks), each with per-message overhead
//! (QUIC stream and packet headers, chitchat's framing). A member is a party to about
//! `2 × fanout` exchanges per round, so, sent plus received,
//!
//! ```text
//! cluster(M, T, f, churn) = (1/T) · 2·f' · (3·h + 2·M·e) + 2 · churn,   f' = min(f, M − 1)
//! ```
//!
//! for a cluster of `M` members, `e` bytes per digest entry ([`GossipByteModel::digest_entry_bytes`])
//! and `h` bytes of overhead per message ([`GossipByteModel::message_overhead_bytes`]); `churn` is
//! the bytes per second of key-values the cluster's members change, each of which every member
//! receives about once and, summed over the cluster, sends about once (a delta carries only a
//! key's latest version, so a key changing faster than once a round costs once a round).
//!
//! Layouts ([`GossipLayout`]):
//! - `flat`: one cluster of all `N` nodes; churn = every busy replica's changing part (its
//!   `rload:` record, at most once per `replica_load_interval`; `mesh/replica_load.rs`) and
//!   every node's own records (`rtt` every 2 s; `inflight` no longer changes with requests).
//!   Bytes per node grow linearly with `N`.
//! - `regional`: one cluster per region of `P = N / R` nodes (churn: the region's replica
//!   records, its nodes' records, and the `R − 1` other regions' records its representatives
//!   copy in) plus, on `k` representatives per region, a cluster of the `k·R` representatives
//!   at [`GossipByteModel::region_interval_s`] whose churn is every region's record. Bytes per
//!   node grow with `P` and with `R` (the region records), not with `N`.
//!
//! `e` and `h` are fitted ([`GossipByteModel::fit`]) to live measurements ([`CALIBRATION`]); the
//! record sizes are the schema's (`mesh/schema.rs`, base64 msgpack, ≤ 1 KiB a value).

use serde::Serialize;

/// Representatives per region in the regional layout: the rendezvous winners among its live
/// nodes (two, so one failing leaves the region heard while a new one is chosen).
pub const REPRESENTATIVES: usize = 2;

/// How the mesh's gossip is laid out.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum GossipLayout {
    /// One chitchat cluster of every node.
    Flat,
    /// A cluster per region, plus a cluster of the regions' representatives.
    #[default]
    Regional,
}

impl GossipLayout {
    /// Both layouts, flat first (the report prints them side by side).
    pub const ALL: [GossipLayout; 2] = [GossipLayout::Flat, GossipLayout::Regional];

    /// The name on the command line and in reports.
    pub fn as_str(self) -> &'static str {
        match self {
            GossipLayout::Flat => "flat",
            GossipLayout::Regional => "regional",
        }
    }
}

impl std::str::FromStr for GossipLayout {
    type Err = String;

    /// `flat` or `regional`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "flat" => Ok(GossipLayout::Flat),
            "regional" => Ok(GossipLayout::Regional),
            other => Err(format!(
                "unknown gossip layout '{other}' (expected flat or regional)"
            )),
        }
    }
}

impl std::fmt::Display for GossipLayout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The mesh whose gossip bytes are modelled.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MeshShape {
    /// The gossip layout.
    pub layout: GossipLayout,
    /// Router nodes `N`.
    pub nodes: usize,
    /// Regions `R` (nodes and replicas are spread evenly over them).
    pub regions: usize,
    /// Engine replicas, all regions together.
    pub replicas: usize,
    /// Requests per second, the whole mesh together (0 = idle).
    pub request_rate: f64,
    /// Gossip interval of the flat or regional cluster, seconds (chitchat's default 0.1).
    pub interval_s: f64,
    /// Peers a node starts an exchange with per round (chitchat's default 3).
    pub fanout: usize,
}

impl MeshShape {
    /// The same mesh laid out as `layout`.
    pub fn with_layout(self, layout: GossipLayout) -> Self {
        MeshShape { layout, ..self }
    }

    /// Members of a node's own (flat or regional) cluster.
    pub fn members(&self) -> f64 {
        let n = self.nodes.max(1) as f64;
        match self.layout {
            GossipLayout::Flat => n,
            GossipLayout::Regional => n / self.regions.max(1) as f64,
        }
    }
}

/// Bytes per second a node sends and receives on gossip (both directions summed).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct NodeBytes {
    /// A node that is not a representative (every node, in the flat layout).
    pub member: f64,
    /// A representative (its region cluster and the representatives' cluster); equal to
    /// `member` in the flat layout or with one region.
    pub representative: f64,
    /// The mean over every node.
    pub mean: f64,
}

impl NodeBytes {
    /// `mean` in KiB/s.
    pub fn mean_kib(&self) -> f64 {
        self.mean / 1024.0
    }

    /// `representative` in KiB/s.
    pub fn representative_kib(&self) -> f64 {
        self.representative / 1024.0
    }
}

/// One live measurement of gossip traffic the model is fitted to.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CalibrationPoint {
    /// The mesh measured (interval and fan-out as it ran).
    pub shape: MeshShape,
    /// Measured KiB/s per node, sent plus received, mean over the nodes.
    pub kib_per_s: f64,
}

/// A regional mesh of `nodes` in `regions` regions with 2 simulated replicas per region, idle,
/// as `scripts/mesh-scale.py` measured it (gossip 200 ms, fan-out 3).
const fn live_regional(nodes: usize, regions: usize, kib_per_s: f64) -> CalibrationPoint {
    CalibrationPoint {
        shape: MeshShape {
            layout: GossipLayout::Regional,
            nodes,
            regions,
            replicas: 2 * regions,
            request_rate: 0.0,
            interval_s: 0.2,
            fanout: 3,
        },
        kib_per_s,
    }
}

/// The live points [`GossipByteModel::calibrated`] is fitted to: the wire (every UDP byte of the
/// mesh endpoint, `kvmesh_mesh_udp_bytes_total`, sent plus received, mean over the nodes) of
/// idle regional meshes of N `kvmesh serve` processes on loopback, measured with
/// `scripts/mesh-scale.py --worker-threads 1 --idle-s 15 --replicas-per-region 2` at the node's
/// defaults (gossip 200 ms, zstd on the wire, region layer every 1 s); docs/benchmarks-notebook.md,
/// "The mesh at scale". The wire is compressed, so `e` is a compressed digest entry and `h`
/// carries QUIC's packet and ACK overhead. (The first fit used the issue #17 table: one flat
/// cluster at 100 ms, uncompressed payload: 10 nodes 57, 30 nodes 166, 60 nodes 436 KiB/s.)
pub const CALIBRATION: [CalibrationPoint; 5] = [
    live_regional(10, 1, 17.58),
    live_regional(30, 3, 18.30),
    live_regional(60, 6, 22.65),
    live_regional(100, 10, 25.79),
    live_regional(100, 4, 29.68),
];

/// A busy live measurement: the gossip bytes per second a node spent beyond the same mesh idle.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BusyPoint {
    /// The mesh measured, with its request rate.
    pub shape: MeshShape,
    /// Bytes per second per node, sent plus received, on the wire, beyond the idle window's.
    pub extra_bytes_per_s: f64,
}

/// The busy point the replicas' changing parts are sized by
/// ([`GossipByteModel::fit_churn`]): `scripts/mesh-scale.py --worker-threads 1 --idle-s 15
/// --nodes 30 --regions 1 --replicas-per-region 8 --busy-rps 100 --busy-s 20`, so 12.5 req/s per
/// replica: every replica's `rload:` record goes out about once a second (with each scrape).
/// Gossip payload (`kvmesh_mesh_gossip_bytes_total`, the load-sharing datagrams apart) was
/// 24,105 B/s per node busy against 23,541 idle; the 564 B/s it added, times the
/// wire-to-payload ratio of the idle window (29,866 / 23,541 = 1.27), is 716 B/s on the wire:
/// 45 B per change, compressed.
pub const BUSY_CALIBRATION: BusyPoint = BusyPoint {
    shape: MeshShape {
        layout: GossipLayout::Regional,
        nodes: 30,
        regions: 1,
        replicas: 8,
        request_rate: 100.0,
        interval_s: 0.2,
        fanout: 3,
    },
    extra_bytes_per_s: 716.0,
};

/// The constants of the byte model (see the module doc for the formula).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct GossipByteModel {
    /// Bytes one member adds to a digest (node id, generation, heartbeat, versions). Fitted.
    pub digest_entry_bytes: f64,
    /// Bytes every gossip message costs beyond its digest and delta (QUIC stream and packet
    /// headers, chitchat framing). Fitted.
    pub message_overhead_bytes: f64,
    /// Bytes of one replica's changing part in a delta (`rload:<id>` key, version, 72 B of
    /// base64 msgpack with one-letter names before compression). Fitted to
    /// [`BUSY_CALIBRATION`]; 100 before the fit. (A whole record, ~400 B, goes out only when a
    /// fact, the health or the epoch changes: not at all on a steady fleet, so not in the churn.)
    pub replica_load_bytes: f64,
    /// Least time between two of a replica's `rload:` publications, seconds (the node's
    /// `mesh.replica_load_interval_ms`).
    pub replica_load_interval_s: f64,
    /// Bytes of one of a node's own records in a delta (`rtt`, and `inflight` / `homes` when
    /// quota tenants or homes change).
    pub node_record_bytes: f64,
    /// Changes per second of a node's own records on an idle mesh (`rtt` every 2 s).
    pub node_record_idle_rate: f64,
    /// Bytes of one region record (offers, forwarding targets, ≤ 32 heads; ≤ 1 KiB).
    pub region_record_bytes: f64,
    /// Representatives per region (rendezvous winners among its live nodes).
    pub representatives: usize,
    /// Gossip interval of the representatives' cluster, which is also how often a busy region's
    /// record is refreshed, seconds.
    pub region_interval_s: f64,
    /// Fan-out of the representatives' cluster.
    pub region_fanout: usize,
}

impl GossipByteModel {
    /// The model's fixed constants with nothing fitted yet (`e = h = 0`).
    pub const UNFITTED: GossipByteModel = GossipByteModel {
        digest_entry_bytes: 0.0,
        message_overhead_bytes: 0.0,
        replica_load_bytes: 100.0,
        replica_load_interval_s: 1.0,
        node_record_bytes: 100.0,
        node_record_idle_rate: 0.5,
        region_record_bytes: 1024.0,
        representatives: REPRESENTATIVES,
        region_interval_s: 1.0,
        region_fanout: 3,
    };

    /// The model fitted to [`CALIBRATION`], its busy churn to [`BUSY_CALIBRATION`].
    pub fn calibrated() -> GossipByteModel {
        GossipByteModel::UNFITTED
            .fit(&CALIBRATION)
            .fit_churn(&BUSY_CALIBRATION)
    }

    /// This model with `replica_load_bytes` set so that `busy`'s replicas' changes cost what
    /// was measured (the other busy terms, nodes' and regions' records, at their constants).
    /// A point whose replicas do not change leaves it as it was.
    pub fn fit_churn(self, busy: &BusyPoint) -> GossipByteModel {
        let idle = MeshShape {
            request_rate: 0.0,
            ..busy.shape
        };
        let without = GossipByteModel {
            replica_load_bytes: 0.0,
            ..self
        };
        let per_byte = GossipByteModel {
            replica_load_bytes: 1.0,
            ..self
        };
        let other = without.per_node(&busy.shape).mean - without.per_node(&idle).mean;
        let unit = per_byte.per_node(&busy.shape).mean - without.per_node(&busy.shape).mean;
        if unit <= 0.0 || busy.extra_bytes_per_s <= 0.0 {
            return self;
        }
        GossipByteModel {
            replica_load_bytes: ((busy.extra_bytes_per_s - other) / unit).max(0.0),
            ..self
        }
    }

    /// This model with `digest_entry_bytes` and `message_overhead_bytes` fitted to `points` by
    /// least squares on the relative error (a point of 60 nodes weighs as much as one of 10),
    /// neither below zero: the prediction is linear in the two, so the fit is a 2 × 2 normal
    /// equation, or a one-variable fit when the free solution has a negative constant. Too
    /// few points, or points that cannot tell the two apart, leave them as they were.
    pub fn fit(self, points: &[CalibrationPoint]) -> GossipByteModel {
        // prediction = e·a + h·b + c, each term read off the model at unit constants.
        let with = |e: f64, h: f64| GossipByteModel {
            digest_entry_bytes: e,
            message_overhead_bytes: h,
            ..self
        };
        let rows: Vec<(f64, f64, f64)> = points
            .iter()
            .filter(|p| p.kib_per_s > 0.0)
            .map(|p| {
                let y = p.kib_per_s * 1024.0;
                let c = with(0.0, 0.0).per_node(&p.shape).mean;
                let a = with(1.0, 0.0).per_node(&p.shape).mean - c;
                let b = with(0.0, 1.0).per_node(&p.shape).mean - c;
                // Divided by the measurement: relative error.
                (a / y, b / y, (y - c) / y)
            })
            .collect();
        let (mut saa, mut sab, mut sbb, mut say, mut sby) = (0.0, 0.0, 0.0, 0.0, 0.0);
        for (a, b, y) in &rows {
            saa += a * a;
            sab += a * b;
            sbb += b * b;
            say += a * y;
            sby += b * y;
        }
        let det = saa * sbb - sab * sab;
        let (mut e, mut h) = if det.abs() > f64::EPSILON * saa * sbb && rows.len() >= 2 {
            ((say * sbb - sab * sby) / det, (saa * sby - sab * say) / det)
        } else {
            (-1.0, -1.0)
        };
        if e < 0.0 || h < 0.0 {
            // The best fit with one of them at zero; the better of the two feasible ones.
            let only_e = (saa > 0.0).then(|| (say / saa).max(0.0));
            let only_h = (sbb > 0.0).then(|| (sby / sbb).max(0.0));
            let sse = |e: f64, h: f64| -> f64 {
                rows.iter()
                    .map(|(a, b, y)| (a * e + b * h - y).powi(2))
                    .sum()
            };
            (e, h) = match (only_e, only_h) {
                (Some(e), Some(h)) if sse(0.0, h) < sse(e, 0.0) => (0.0, h),
                (Some(e), _) => (e, 0.0),
                (None, Some(h)) => (0.0, h),
                (None, None) => (self.digest_entry_bytes, self.message_overhead_bytes),
            };
        }
        with(e, h)
    }

    /// Bytes per second (sent + received) one member of a cluster of `members` spends on its
    /// exchanges every `interval_s` with `fanout` peers, with `churn` bytes per second of
    /// changed key-values to spread.
    pub fn cluster(&self, members: f64, interval_s: f64, fanout: usize, churn: f64) -> f64 {
        if members < 2.0 || interval_s <= 0.0 {
            return 0.0;
        }
        let f = (fanout as f64).min(members - 1.0);
        let round =
            2.0 * f * (3.0 * self.message_overhead_bytes + 2.0 * members * self.digest_entry_bytes);
        round / interval_s + 2.0 * churn
    }

    /// Bytes per second (sent + received) a node of `shape` spends on gossip.
    pub fn per_node(&self, shape: &MeshShape) -> NodeBytes {
        let n = shape.nodes.max(1) as f64;
        let regions = shape.regions.clamp(1, shape.nodes.max(1));
        let r = regions as f64;
        let rate = shape.request_rate.max(0.0);
        let interval = shape.interval_s;
        // A key changes at most once per round as far as deltas go (only its latest version
        // travels), and a home republishes a replica's changing part at most once an interval:
        // a busy replica costs at most once per the longer of the two.
        let period = interval.max(self.replica_load_interval_s);
        let per_period = if period > 0.0 { 1.0 / period } else { 0.0 };
        let replica_churn = |replicas: f64| {
            let each = (rate / shape.replicas.max(1) as f64).min(per_period);
            replicas * each * self.replica_load_bytes
        };
        // A node's own records change on their own clock (`rtt`), not with requests.
        let node_churn = |nodes: f64| nodes * self.node_record_idle_rate * self.node_record_bytes;
        // A busy region's record changes at every refresh; an idle one not at all.
        let region_rate = if rate > 0.0 && self.region_interval_s > 0.0 {
            1.0 / self.region_interval_s
        } else {
            0.0
        };
        let region_churn = |records: f64| records * region_rate * self.region_record_bytes;
        if shape.layout == GossipLayout::Flat || regions == 1 {
            let churn = replica_churn(shape.replicas as f64) + node_churn(n);
            let b = self.cluster(n, interval, shape.fanout, churn);
            return NodeBytes {
                member: b,
                representative: b,
                mean: b,
            };
        }
        let p = n / r;
        let churn =
            replica_churn(shape.replicas as f64 / r) + node_churn(p) + region_churn(r - 1.0);
        let member = self.cluster(p, interval, shape.fanout, churn);
        let k = (self.representatives as f64).min(p).max(1.0);
        let layer = self.cluster(
            k * r,
            self.region_interval_s,
            self.region_fanout,
            region_churn(r),
        );
        NodeBytes {
            member,
            representative: member + layer,
            mean: member + layer * k * r / n,
        }
    }
}

/// The model for `nodes` in regions of `region_size` nodes (`ceil(nodes / region_size)`
/// regions), `replicas_per_node` replicas per node, each node routing `rate_per_node` req/s:
/// the mesh of one row of `kvmesh sim --byte-table`.
pub fn table_shape(
    layout: GossipLayout,
    nodes: usize,
    region_size: usize,
    replicas_per_node: usize,
    rate_per_node: f64,
) -> MeshShape {
    MeshShape {
        layout,
        nodes,
        regions: nodes.div_ceil(region_size.max(1)).max(1),
        replicas: nodes * replicas_per_node,
        request_rate: nodes as f64 * rate_per_node,
        interval_s: 0.1,
        fanout: 3,
    }
}

/// Nodes of each row of the growth table.
pub const TABLE_NODES: [usize; 7] = [10, 30, 60, 100, 200, 1_000, 10_000];

/// Nodes per region in the growth table's regional rows.
pub const TABLE_REGION_SIZE: usize = 25;

/// Replicas per node in the growth table (the fleet-scale sim's 10,000 over 1,000 nodes).
pub const TABLE_REPLICAS_PER_NODE: usize = 10;

/// Requests per second each node routes in the table's busy columns (the fleet-scale sim's
/// 20,000 req/s over 1,000 nodes).
pub const TABLE_RATE_PER_NODE: f64 = 20.0;

/// The growth table, Markdown: KiB/s per node, flat against regional (regions of
/// [`TABLE_REGION_SIZE`]), idle and busy, for [`TABLE_NODES`].
pub fn byte_table(model: &GossipByteModel) -> String {
    let mut s = format!(
        "Gossip bytes per node (model), KiB/s sent + received; {TABLE_REPLICAS_PER_NODE} replicas \
         per node; busy = {TABLE_RATE_PER_NODE} req/s per node; regional: regions of \
         {TABLE_REGION_SIZE} nodes, {} representatives each (mean over nodes / a representative)\n\
         Fitted: digest entry {:.1} B, message overhead {:.1} B\n\n\
         | nodes | regions | flat idle | flat busy | regional idle | regional busy | regional busy, representative |\n\
         |---:|---:|---:|---:|---:|---:|---:|\n",
        model.representatives, model.digest_entry_bytes, model.message_overhead_bytes
    );
    for &n in &TABLE_NODES {
        let at = |layout, rate| {
            model.per_node(&table_shape(
                layout,
                n,
                TABLE_REGION_SIZE,
                TABLE_REPLICAS_PER_NODE,
                rate,
            ))
        };
        let busy = at(GossipLayout::Regional, TABLE_RATE_PER_NODE);
        s.push_str(&format!(
            "| {n} | {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} |\n",
            n.div_ceil(TABLE_REGION_SIZE),
            at(GossipLayout::Flat, 0.0).mean_kib(),
            at(GossipLayout::Flat, TABLE_RATE_PER_NODE).mean_kib(),
            at(GossipLayout::Regional, 0.0).mean_kib(),
            busy.mean_kib(),
            busy.representative_kib(),
        ));
    }
    s
}

/// The report's lines: KiB/s per node of `shape` in both layouts, idle and at its rate;
/// `this_run` marks the layout the run simulated (none when it ran both).
pub fn mesh_bytes_markdown(
    model: &GossipByteModel,
    shape: &MeshShape,
    this_run: Option<GossipLayout>,
) -> String {
    let mut s = format!(
        "Mesh bytes per node (model: chitchat digests + deltas, `sim_bytes.rs`; digest entry \
         {:.1} B, message overhead {:.1} B), KiB/s sent + received, {} nodes, {} region(s), {} \
         replicas:\n\n\
         | layout | gossip members | idle (mean) | at {:.0} req/s (mean) | at {:.0} req/s (representative) |\n\
         |---|---:|---:|---:|---:|\n",
        model.digest_entry_bytes,
        model.message_overhead_bytes,
        shape.nodes,
        shape.regions,
        shape.replicas,
        shape.request_rate,
        shape.request_rate,
    );
    for layout in GossipLayout::ALL {
        let here = shape.with_layout(layout);
        let idle = model.per_node(&MeshShape {
            request_rate: 0.0,
            ..here
        });
        let busy = model.per_node(&here);
        let marker = if this_run == Some(layout) {
            " (this run)"
        } else {
            ""
        };
        s.push_str(&format!(
            "| {layout}{marker} | {:.0} | {:.1} | {:.1} | {:.1} |\n",
            here.members(),
            idle.mean_kib(),
            busy.mean_kib(),
            busy.representative_kib(),
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(layout: GossipLayout, nodes: usize, regions: usize, rate: f64) -> MeshShape {
        MeshShape {
            layout,
            nodes,
            regions,
            replicas: nodes * 10,
            request_rate: rate,
            interval_s: 0.1,
            fanout: 3,
        }
    }

    #[test]
    fn the_fit_reproduces_every_calibration_point_within_a_quarter() {
        let m = GossipByteModel::calibrated();
        assert!(m.digest_entry_bytes > 0.0 && m.message_overhead_bytes >= 0.0);
        for p in CALIBRATION {
            let kib = m.per_node(&p.shape).mean_kib();
            let err = (kib - p.kib_per_s).abs() / p.kib_per_s;
            assert!(
                err <= 0.25,
                "{} nodes: model {kib:.1} vs measured {}",
                p.shape.nodes,
                p.kib_per_s
            );
        }
    }

    #[test]
    fn the_fit_recovers_constants_that_made_the_points() {
        let truth = GossipByteModel {
            digest_entry_bytes: 48.0,
            message_overhead_bytes: 90.0,
            ..GossipByteModel::UNFITTED
        };
        let points: Vec<CalibrationPoint> = [5, 20, 80]
            .into_iter()
            .map(|n| {
                let shape = shape(GossipLayout::Flat, n, 1, 0.0);
                CalibrationPoint {
                    shape,
                    kib_per_s: truth.per_node(&shape).mean_kib(),
                }
            })
            .collect();
        let fit = GossipByteModel::UNFITTED.fit(&points);
        assert!((fit.digest_entry_bytes - 48.0).abs() < 1e-6, "{fit:?}");
        assert!((fit.message_overhead_bytes - 90.0).abs() < 1e-6, "{fit:?}");
    }

    #[test]
    fn a_fit_never_goes_negative_and_too_few_points_change_nothing() {
        // Superlinear points would want a negative overhead: it stays at zero.
        let superlinear = [(10, 10.0), (100, 200.0)].map(|(n, kib)| CalibrationPoint {
            shape: shape(GossipLayout::Flat, n, 1, 0.0),
            kib_per_s: kib,
        });
        let fit = GossipByteModel::UNFITTED.fit(&superlinear);
        assert!(fit.digest_entry_bytes > 0.0);
        assert_eq!(fit.message_overhead_bytes, 0.0);
        let m = GossipByteModel::calibrated();
        assert_eq!(m.fit(&[]), m);
    }

    #[test]
    fn a_lone_node_or_a_lone_member_gossips_nothing() {
        let m = GossipByteModel::calibrated();
        assert_eq!(m.per_node(&shape(GossipLayout::Flat, 1, 1, 0.0)).mean, 0.0);
        assert_eq!(m.cluster(1.0, 0.1, 3, 1e6), 0.0);
    }

    #[test]
    fn flat_bytes_grow_linearly_with_nodes_and_regional_ones_do_not() {
        let m = GossipByteModel::calibrated();
        let flat = |n| m.per_node(&shape(GossipLayout::Flat, n, 1, 0.0)).mean;
        let ratio = flat(1000) / flat(100);
        // Linear in the members, plus a fixed per-message overhead.
        assert!((7.5..=10.5).contains(&ratio), "flat ×{ratio}");
        // Regions of 25: the same cost per node at 100 or 1,000 nodes, idle.
        let regional = |n: usize| {
            m.per_node(&shape(GossipLayout::Regional, n, n / 25, 0.0))
                .mean
        };
        let ratio = regional(1000) / regional(100);
        assert!((0.95..=1.1).contains(&ratio), "regional ×{ratio}");
        assert!(regional(1000) < flat(1000) / 20.0);
    }

    #[test]
    fn busy_replicas_add_their_changing_parts_at_most_once_an_interval() {
        let m = GossipByteModel::calibrated();
        let b = m.replica_load_bytes;
        let at = |rate| m.per_node(&shape(GossipLayout::Flat, 10, 1, rate)).mean;
        // 100 replicas at 0.5 req/s each: 100 changing parts × b bytes × 0.5/s, received and
        // sent; nodes' own records do not change with requests.
        let extra = at(50.0) - at(0.0);
        assert!((extra - 2.0 * (100.0 * b * 0.5)).abs() < 1e-6, "{extra}");
        // At any higher rate each replica's part goes out once a second (the interval), no
        // more, though gossip rounds are 100 ms.
        let capped = at(10_000.0) - at(0.0);
        assert!((capped - 2.0 * (100.0 * b)).abs() < 1e-6, "{capped}");
    }

    #[test]
    fn the_changing_parts_are_sized_by_the_busy_live_point() {
        let m = GossipByteModel::calibrated();
        // 716 B/s over 8 replicas changing once a second, sent and received: ~45 B a change.
        assert!((m.replica_load_bytes - 716.0 / 16.0).abs() < 1e-9, "{m:?}");
        let p = BUSY_CALIBRATION;
        let idle = MeshShape {
            request_rate: 0.0,
            ..p.shape
        };
        let extra = m.per_node(&p.shape).mean - m.per_node(&idle).mean;
        assert!((extra - p.extra_bytes_per_s).abs() < 1e-6, "{extra}");
        // A point where nothing changes tells nothing.
        let still = BusyPoint {
            shape: idle,
            extra_bytes_per_s: 500.0,
        };
        assert_eq!(m.fit_churn(&still), m);
    }

    #[test]
    fn representatives_pay_for_the_region_layer_and_the_mean_shares_it() {
        let m = GossipByteModel::calibrated();
        let b = m.per_node(&shape(GossipLayout::Regional, 100, 4, 1000.0));
        assert!(b.representative > b.member);
        // 8 of the 100 nodes are representatives.
        let share = (b.mean - b.member) / (b.representative - b.member);
        assert!((share - 0.08).abs() < 1e-9, "{share}");
        // One region: no region layer, regional is flat.
        let one = shape(GossipLayout::Regional, 30, 1, 100.0);
        assert_eq!(
            m.per_node(&one),
            m.per_node(&one.with_layout(GossipLayout::Flat))
        );
    }

    #[test]
    fn layouts_parse_and_print_by_name() {
        for l in GossipLayout::ALL {
            assert_eq!(l.as_str().parse::<GossipLayout>(), Ok(l));
        }
        assert!("ring".parse::<GossipLayout>().is_err());
        assert_eq!(GossipLayout::default(), GossipLayout::Regional);
    }

    #[test]
    fn the_report_shows_both_layouts_and_marks_the_one_simulated() {
        let m = GossipByteModel::calibrated();
        let s = shape(GossipLayout::Regional, 1000, 10, 20_000.0);
        let one = mesh_bytes_markdown(&m, &s, Some(GossipLayout::Regional));
        assert!(one.contains("| flat | 1000 |") && one.contains("| regional (this run) | 100 |"));
        let both = mesh_bytes_markdown(&m, &s, None);
        assert!(!both.contains("this run"));
    }

    #[test]
    fn the_growth_table_has_a_row_per_size() {
        let t = byte_table(&GossipByteModel::calibrated());
        assert!(t.contains("| 10000 | 400 |"), "{t}");
        assert_eq!(
            t.lines().filter(|l| l.starts_with("| ")).count(),
            1 + TABLE_NODES.len()
        );
    }
}
