//! The pick as the gateway reads it: `ip:port` of the chosen replica (at its data-parallel
//! rank's port), then fallbacks; which replicas a subset hint leaves eligible; and which
//! replica an endpoint the gateway reports names.
//!
//! Exists because the picker names places, not replicas: a replica is its URL's host and port,
//! and a replica with data-parallel ranks is one port per rank (an InferencePool's
//! `targetPorts`): rank r at `picker.rank_ports[r]`, or at the URL's port + r when none are
//! configured. Fallbacks are the next best decisions with the ones named excluded, made by the
//! same router but not booked: only the endpoint that serves is accounted (`stream.rs`).

use std::collections::HashSet;
use std::sync::Arc;

use crate::core::router::{Decision, RouteRequest};
use crate::node::config::PickerSection;
use crate::node::{Node, Ticket};
use crate::replicas::kv_events::RankRouting;

/// The host and port of a replica's base URL (`http://10.0.0.5:8000` → `10.0.0.5`, 8000; an
/// IPv6 host keeps its brackets); the scheme's port when the URL names none.
pub fn authority(base: &str) -> Option<(&str, u16)> {
    let (rest, default_port) = match base.split_once("://") {
        Some(("https", r)) => (r, 443),
        Some((_, r)) => (r, 80),
        None => (base, 80),
    };
    let auth = rest.split('/').next()?;
    let colon = auth.rfind(':').filter(|&c| !auth[c..].contains(']'));
    match colon {
        Some(c) => Some((&auth[..c], auth[c + 1..].parse().ok()?)),
        None if !auth.is_empty() => Some((auth, default_port)),
        None => None,
    }
}

/// The port rank `rank` of a replica whose URL port is `port` is served at.
pub fn rank_port(port: u16, rank: u16, rank_ports: &[u16]) -> Option<u16> {
    if rank_ports.is_empty() {
        port.checked_add(rank)
    } else {
        rank_ports.get(usize::from(rank)).copied()
    }
}

/// The ranks replica `i` is addressed by port: its data-parallel ranks when the node names
/// them, else 1 (the URL's port alone).
fn named_ranks(node: &Node, i: usize) -> u16 {
    node.lock()
        .replicas
        .get(i)
        .and_then(|rt| rt.kv_source.as_ref())
        .filter(|s| s.rank_routing() != RankRouting::Off)
        .map_or(1, |s| s.dp_ranks.max(1))
}

/// The ports replica `i` (URL port `port`) is served at, rank by rank.
fn ports<'r>(
    node: &Node,
    i: usize,
    port: u16,
    rank_ports: &'r [u16],
) -> impl Iterator<Item = u16> + 'r {
    let ranks = named_ranks(node, i);
    (0..ranks).filter_map(move |r| rank_port(port, r, rank_ports))
}

/// A gateway's subset hint: the `ip:port` (or bare `ip`: any port) entries it allows, parsed
/// once per request so that checking every replica's ports against it is a set lookup each
/// (a hint may list thousands of entries). An entry with a port that is not a number allows
/// nothing.
pub struct Subset<'a> {
    /// `host:port` entries, the host without IPv6 brackets.
    exact: HashSet<(&'a str, u16)>,
    /// Bare `host` entries, without brackets: any port.
    any_port: HashSet<&'a str>,
}

/// `[v6]` and `v6` compare alike.
fn bare(host: &str) -> &str {
    host.trim_start_matches('[').trim_end_matches(']')
}

impl<'a> Subset<'a> {
    /// The entries of a hint (as `wire::subset_hint` reads them).
    pub fn parse(entries: &'a [String]) -> Self {
        let mut subset = Subset {
            exact: HashSet::with_capacity(entries.len()),
            any_port: HashSet::new(),
        };
        for e in entries {
            match split_entry(e) {
                (h, Some(Ok(port))) => {
                    subset.exact.insert((bare(h), port));
                }
                (h, None) => {
                    subset.any_port.insert(bare(h));
                }
                (_, Some(Err(_))) => {}
            }
        }
        subset
    }

    /// Whether `host:port` is allowed.
    pub fn allows(&self, host: &str, port: u16) -> bool {
        let host = bare(host);
        self.any_port.contains(host) || self.exact.contains(&(host, port))
    }
}

/// An entry's host and port (`None`: any port; `Some(Err)`: a port that is not a number).
fn split_entry(e: &str) -> (&str, Option<Result<u16, std::num::ParseIntError>>) {
    if let Some(rest) = e.strip_prefix('[') {
        return match rest.split_once("]:") {
            Some((h, p)) => (h, Some(p.parse())),
            None => (rest.trim_end_matches(']'), None),
        };
    }
    match e.split_once(':') {
        // One colon: host and port; more: a bare IPv6 address.
        Some((h, p)) if !p.contains(':') => (h, Some(p.parse())),
        _ => (e, None),
    }
}

/// Replicas the subset leaves out, in ascending order: those with no allowed `host:port` at
/// any of their ranks.
pub fn excluded_by(node: &Node, subset: &Subset<'_>, rank_ports: &[u16]) -> Vec<usize> {
    (0..node.replica_count())
        .filter(|&i| {
            let allowed = node.endpoint(i).is_some_and(|e| match authority(&e.base) {
                Some((host, port)) => {
                    ports(node, i, port, rank_ports).any(|p| subset.allows(host, p))
                }
                None => false,
            });
            !allowed
        })
        .collect()
}

/// `host:port` where replica `i` takes a request: at `rank`'s port when one is named (and the
/// subset allows it), else the first port of its ranks the subset allows.
fn place(
    node: &Node,
    i: usize,
    base: &str,
    rank: Option<u16>,
    subset: Option<&Subset<'_>>,
    rank_ports: &[u16],
) -> Option<String> {
    let (host, port) = authority(base)?;
    let named = rank.and_then(|r| rank_port(port, r, rank_ports));
    let chosen = match (named, subset) {
        (Some(p), Some(s)) if s.allows(host, p) => p,
        (Some(p), None) => p,
        (_, Some(s)) => ports(node, i, port, rank_ports).find(|&p| s.allows(host, p))?,
        (None, None) => port,
    };
    Some(format!("{host}:{chosen}"))
}

/// `host:port` where replica `i` takes a request (see `place`), by its index.
pub fn place_of(
    node: &Node,
    i: usize,
    rank: Option<u16>,
    subset: Option<&Subset<'_>>,
    rank_ports: &[u16],
) -> Option<String> {
    let e = node.endpoint(i)?;
    place(node, i, &e.base, rank, subset, rank_ports)
}

/// What a pick names: the endpoints in the gateway's order, and where the first is.
pub struct Named {
    /// `ip:port[,ip:port…]`: the pick, then its fallbacks.
    pub endpoints: String,
    /// Length of the first endpoint in `endpoints`.
    pub primary_len: usize,
}

impl Named {
    /// The picked endpoint alone.
    pub fn primary(&self) -> &str {
        &self.endpoints[..self.primary_len]
    }
}

/// Names the pick booked in `ticket` and up to `cfg.fallbacks` next best replicas for `req`
/// (its exclusions kept). `None` when the replica's URL has no host.
pub fn name(
    node: &Arc<Node>,
    ticket: &Ticket,
    req: &RouteRequest<'_>,
    subset: Option<&Subset<'_>>,
    cfg: &PickerSection,
) -> Option<Named> {
    let i = ticket.replica();
    let rank = ticket.rank().map(|r| r.rank);
    let mut endpoints = place(
        node,
        i,
        &ticket.endpoint().base,
        rank,
        subset,
        &cfg.rank_ports,
    )?;
    let primary_len = endpoints.len();
    if cfg.fallbacks == 0 {
        return Some(Named {
            endpoints,
            primary_len,
        });
    }
    let mut exclude = Vec::with_capacity(req.exclude.len() + 1 + cfg.fallbacks as usize);
    exclude.extend_from_slice(req.exclude);
    exclude.push(i);
    for _ in 0..cfg.fallbacks {
        let now = node.now();
        let decision = {
            let mut guard = node.lock();
            let core = &mut *guard;
            let next = RouteRequest {
                exclude: &exclude,
                ..*req
            };
            core.router.route(&core.view, &next, now)
        };
        let Decision::Route(d) = decision else { break };
        exclude.push(d.replica);
        if let Some(p) = place_of(node, d.replica, None, subset, &cfg.rank_ports) {
            endpoints.push(',');
            endpoints.push_str(&p);
        }
    }
    Some(Named {
        endpoints,
        primary_len,
    })
}

/// The replica served at `endpoint` (`ip:port`, any of its ranks' ports).
pub fn replica_at(node: &Node, endpoint: &str, rank_ports: &[u16]) -> Option<usize> {
    let (host, port) = split_entry(endpoint.trim());
    let port = port?.ok()?;
    (0..node.replica_count()).find(|&i| {
        node.endpoint(i).is_some_and(|e| match authority(&e.base) {
            Some((h, p)) => {
                bare(h) == bare(host) && ports(node, i, p, rank_ports).any(|q| q == port)
            }
            None => false,
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn authorities_ports_and_subsets() {
        assert_eq!(authority("http://10.0.0.5:8000"), Some(("10.0.0.5", 8000)));
        assert_eq!(authority("https://10.0.0.5/v1"), Some(("10.0.0.5", 443)));
        assert_eq!(authority("http://[::1]:9000"), Some(("[::1]", 9000)));
        assert_eq!(authority("http://[::1]"), Some(("[::1]", 80)));
        assert_eq!(authority("http://h:notaport"), None);
        assert_eq!(rank_port(8000, 2, &[]), Some(8002));
        assert_eq!(rank_port(8000, 2, &[3000, 3002, 3004]), Some(3004));
        assert_eq!(rank_port(8000, 3, &[3000, 3002, 3004]), None);
        assert_eq!(rank_port(u16::MAX, 1, &[]), None);
        let entries: Vec<String> = ["10.0.0.1:8000", "10.0.0.2", "[::1]:9000", "fd00::2"]
            .map(String::from)
            .to_vec();
        let s = Subset::parse(&entries);
        assert!(s.allows("10.0.0.1", 8000));
        assert!(!s.allows("10.0.0.1", 8001));
        assert!(s.allows("10.0.0.2", 1234), "a bare ip allows every port");
        assert!(s.allows("[::1]", 9000));
        assert!(s.allows("[fd00::2]", 7));
        assert!(!s.allows("10.0.0.3", 8000));
        assert!(
            !Subset::parse(&[]).allows("10.0.0.1", 8000),
            "an empty hint allows nothing"
        );
        let odd = ["10.0.0.4:http".to_string()];
        assert!(
            !Subset::parse(&odd).allows("10.0.0.4", 80),
            "a port that is not a number allows nothing (it allowed every port)"
        );
    }
}
