//! Which hosts a replica learned from a peer's gossip may live at: the operator's allow-list
//! (`[mesh] learn_replicas_from`), as plain data.
//!
//! Exists because a learned replica gets the learning node's health checks, `/metrics` scrapes
//! and clients' prompts (with their `Authorization` headers): a member that could publish any
//! URL could point every node of the mesh at any host. Rules are hosts (`vllm-3.internal`,
//! `10.0.0.7`), CIDRs (`10.0.0.0/8`, `fd00::/8`), DNS suffixes (`.svc.cluster.local`: the
//! leading dot matches that domain and any name under it) or `*` (anywhere). Names compare
//! case-insensitively without a trailing dot; IPv4-mapped IPv6 addresses match as IPv4.

use std::net::IpAddr;

/// One allow-list entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AllowRule {
    /// Anywhere (`*`).
    Any,
    /// Exactly this host name or address.
    Host(String),
    /// Addresses in this network: base address and prefix length.
    Cidr(IpAddr, u8),
    /// Names under this domain (`.example.com`; stored without the leading dot).
    Suffix(String),
}

fn norm_name(s: &str) -> String {
    s.trim_end_matches('.').to_ascii_lowercase()
}

fn norm_ip(ip: IpAddr) -> IpAddr {
    ip.to_canonical()
}

/// The host part of a URL host string, without IPv6 brackets, normalised.
fn host_key(host: &str) -> Host {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    match bare.parse::<IpAddr>() {
        Ok(ip) => Host::Ip(norm_ip(ip)),
        Err(_) => Host::Name(norm_name(bare)),
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Host {
    Ip(IpAddr),
    Name(String),
}

fn in_network(ip: IpAddr, base: IpAddr, prefix: u8) -> bool {
    match (norm_ip(ip), base) {
        (IpAddr::V4(a), IpAddr::V4(b)) => {
            let mask = u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0);
            u32::from(a) & mask == u32::from(b) & mask
        }
        (IpAddr::V6(a), IpAddr::V6(b)) => {
            let mask = u128::MAX.checked_shl(128 - u32::from(prefix)).unwrap_or(0);
            u128::from(a) & mask == u128::from(b) & mask
        }
        _ => false,
    }
}

impl AllowRule {
    /// Parses one entry; the error says why it is not one.
    pub fn parse(s: &str) -> Result<AllowRule, String> {
        let s = s.trim();
        if s == "*" {
            return Ok(AllowRule::Any);
        }
        if s.is_empty() || s.len() > 253 {
            return Err(format!("{s:?} is not a host, CIDR, .suffix or *"));
        }
        if let Some((ip, prefix)) = s.split_once('/') {
            let ip: IpAddr = ip
                .parse()
                .map_err(|_| format!("{s:?}: {ip:?} is not an IP address"))?;
            let max = if ip.is_ipv4() { 32 } else { 128 };
            let prefix: u8 = prefix
                .parse()
                .ok()
                .filter(|p| *p <= max)
                .ok_or_else(|| format!("{s:?}: the prefix length must be 0..={max}"))?;
            return Ok(AllowRule::Cidr(norm_ip(ip), prefix));
        }
        if let Some(suffix) = s.strip_prefix('.') {
            if suffix.is_empty() || suffix.starts_with('.') {
                return Err(format!("{s:?} is not a DNS suffix"));
            }
            return Ok(AllowRule::Suffix(norm_name(suffix)));
        }
        if s.contains(['/', ':', ' ', '*']) && s.parse::<IpAddr>().is_err() {
            return Err(format!("{s:?} is not a host, CIDR, .suffix or *"));
        }
        Ok(AllowRule::Host(match host_key(s) {
            Host::Ip(ip) => ip.to_string(),
            Host::Name(n) => n,
        }))
    }

    /// Whether `host` (a URL's host: a name, an IPv4 address or a bracketed IPv6 one) matches.
    pub fn matches(&self, host: &str) -> bool {
        let h = host_key(host);
        match (self, &h) {
            (AllowRule::Any, _) => true,
            (AllowRule::Host(want), Host::Ip(ip)) => *want == ip.to_string(),
            (AllowRule::Host(want), Host::Name(n)) => want == n,
            (AllowRule::Cidr(base, prefix), Host::Ip(ip)) => in_network(*ip, *base, *prefix),
            (AllowRule::Suffix(sfx), Host::Name(n)) => {
                n == sfx
                    || n.strip_suffix(sfx.as_str())
                        .is_some_and(|p| p.ends_with('.'))
            }
            _ => false,
        }
    }
}

/// Whether two URL hosts name the same host (normalised as the rules are).
pub fn same_host(a: &str, b: &str) -> bool {
    host_key(a) == host_key(b)
}

/// Whether a URL host is a loopback address or `localhost`.
pub fn is_loopback(host: &str) -> bool {
    match host_key(host) {
        Host::Ip(ip) => ip.is_loopback(),
        Host::Name(n) => n == "localhost" || n.ends_with(".localhost"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_parse_and_match() {
        let cidr = AllowRule::parse("10.0.0.0/8").unwrap();
        assert!(cidr.matches("10.1.2.3"));
        assert!(!cidr.matches("11.0.0.1"));
        assert!(!cidr.matches("vllm.internal"));
        assert!(
            cidr.matches("[::ffff:10.0.0.9]"),
            "mapped v4 matches v4 rules"
        );
        let v6 = AllowRule::parse("fd00::/8").unwrap();
        assert!(v6.matches("[fd12::1]"));
        assert!(!v6.matches("[fe80::1]"));
        let sfx = AllowRule::parse(".svc.cluster.local").unwrap();
        assert!(sfx.matches("vllm-0.vllm.svc.cluster.local"));
        assert!(sfx.matches("SVC.cluster.local."));
        assert!(!sfx.matches("evilsvc.cluster.local"));
        let host = AllowRule::parse("vllm-3.internal").unwrap();
        assert!(host.matches("VLLM-3.internal"));
        assert!(!host.matches("vllm-3.internal.evil"));
        let ip = AllowRule::parse("10.0.0.7").unwrap();
        assert!(ip.matches("10.0.0.7") && !ip.matches("10.0.0.8"));
        assert!(AllowRule::parse("*").unwrap().matches("anything"));
        assert!(AllowRule::parse("0.0.0.0/0").unwrap().matches("1.2.3.4"));
        for bad in [
            "",
            "10.0.0.0/33",
            "x/8",
            ".",
            "..a",
            "a b",
            "::1/129",
            "*.x",
        ] {
            assert!(AllowRule::parse(bad).is_err(), "{bad:?}");
        }
        assert!(is_loopback("127.0.0.2") && is_loopback("[::1]") && is_loopback("localhost"));
        assert!(!is_loopback("10.0.0.1"));
        assert!(same_host("LocalHost.", "localhost"));
    }
}
