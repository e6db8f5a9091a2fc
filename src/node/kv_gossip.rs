//! A replica's KV-event endpoints in its gossip record.
//!
//! Exists so that whichever node becomes a replica's home can subscribe to its engine's events,
//! not only the node whose configuration names them: the home publishes the ports, and a node
//! that learns the replica rebuilds the endpoints at the replica URL's host. The host never
//! comes from a peer — the learned-replica allow-list already vetted the URL — so a record
//! cannot point this node's subscriber anywhere else. Endpoints at another host than the URL's
//! are not published (the followers could not check them).

use crate::mesh::schema::{WireKvEvents, MAX_DP_RANKS, MAX_TOPIC_BYTES};
use crate::replicas::kv_events::{
    default_max_buffered_bytes, default_max_message_bytes, KvEventsSource,
};

/// `(host, port)` of a `tcp://host:port` endpoint.
fn host_port(endpoint: &str) -> Option<(String, u16)> {
    let u = reqwest::Url::parse(endpoint).ok()?;
    (u.scheme() == "tcp").then_some(())?;
    Some((u.host_str()?.to_owned(), u.port()?))
}

fn url_host(url: &str) -> Option<String> {
    reqwest::Url::parse(url).ok()?.host_str().map(str::to_owned)
}

/// The ports to gossip for a replica at `url` whose events come from `source`; none when the
/// endpoints are not at the URL's host or out of the record's bounds.
pub(super) fn to_wire(url: &str, source: &KvEventsSource) -> Option<WireKvEvents> {
    let host = url_host(url)?;
    let (h, port) = host_port(&source.endpoint)?;
    if h != host || source.topic.len() > MAX_TOPIC_BYTES {
        return None;
    }
    if !(1..=MAX_DP_RANKS).contains(&source.dp_ranks) {
        return None;
    }
    let replay_port = match &source.replay {
        None => None,
        Some(r) => {
            let (h, p) = host_port(r)?;
            if h != host {
                return None;
            }
            Some(p)
        }
    };
    Some(WireKvEvents {
        port,
        replay_port,
        topic: source.topic.clone(),
        dp_ranks: source.dp_ranks,
    })
}

/// The event source of a learned replica at `url`, from its record's ports.
pub(super) fn from_wire(url: &str, wire: &WireKvEvents) -> Option<KvEventsSource> {
    let host = url_host(url)?;
    // IPv6 hosts come bracketed from the URL already.
    let tcp = |port: u16| format!("tcp://{host}:{port}");
    Some(KvEventsSource {
        endpoint: tcp(wire.port),
        replay: wire.replay_port.map(tcp),
        topic: wire.topic.clone(),
        dp_ranks: wire.dp_ranks,
        // Not gossiped: a new home of a learned replica uses the default.
        rank_routing: None,
        max_message_bytes: default_max_message_bytes(),
        max_buffered_bytes: default_max_buffered_bytes(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn source(endpoint: &str, replay: Option<&str>) -> KvEventsSource {
        KvEventsSource {
            endpoint: endpoint.into(),
            replay: replay.map(str::to_owned),
            topic: "kv".into(),
            dp_ranks: 2,
            rank_routing: None,
            max_message_bytes: default_max_message_bytes(),
            max_buffered_bytes: default_max_buffered_bytes(),
        }
    }

    #[test]
    fn ports_travel_and_the_host_is_always_the_replicas() {
        let url = "http://10.0.0.5:8000";
        let wire = to_wire(
            url,
            &source("tcp://10.0.0.5:5557", Some("tcp://10.0.0.5:5558")),
        )
        .unwrap();
        assert_eq!(
            (wire.port, wire.replay_port, wire.dp_ranks),
            (5557, Some(5558), 2)
        );
        let back = from_wire(url, &wire).unwrap();
        assert_eq!(back.endpoint, "tcp://10.0.0.5:5557");
        assert_eq!(back.replay.as_deref(), Some("tcp://10.0.0.5:5558"));
        // A learner rebuilds them at the URL it learned, whatever the home saw.
        let moved = from_wire("http://replica.svc:8000", &wire).unwrap();
        assert_eq!(moved.endpoint, "tcp://replica.svc:5557");
    }

    #[test]
    fn endpoints_elsewhere_than_the_replica_are_not_published() {
        let url = "http://10.0.0.5:8000";
        assert!(to_wire(url, &source("tcp://10.0.0.6:5557", None)).is_none());
        assert!(to_wire(url, &source("tcp://10.0.0.5:5557", Some("tcp://evil:1"))).is_none());
        assert!(to_wire(url, &source("ipc:///tmp/x", None)).is_none());
    }
}
