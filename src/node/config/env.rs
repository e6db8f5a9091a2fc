//! `${NAME}` in a config file: the value of environment variable `NAME`, so one file serves every
//! pod or host of a fleet (`advertise = "${POD_IP}:7946"` with the Kubernetes downward API) with
//! no template step before the node starts.
//!
//! Only `${` + an upper-case name (`[A-Z_][A-Z0-9_]*`, at most 128 bytes) + `}` is replaced; `$${`
//! writes a literal `${`. An unset variable is an error naming it, never an empty string: an
//! empty address would fail later and further from the cause. Comments are expanded too.

use super::error::{invalid, ConfigError};

/// Longest variable name.
const MAX_NAME: usize = 128;

/// `text` with every `${NAME}` replaced by `lookup(NAME)`.
pub fn expand(text: &str, lookup: impl Fn(&str) -> Option<String>) -> Result<String, ConfigError> {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("${") {
        // `$${` is an escaped `${`.
        if rest[..at].ends_with('$') {
            out.push_str(&rest[..at - 1]);
            out.push_str("${");
            rest = &rest[at + 2..];
            continue;
        }
        out.push_str(&rest[..at]);
        let after = &rest[at + 2..];
        let end = after.find('}').filter(|e| *e <= MAX_NAME);
        let name = end.map(|e| &after[..e]).filter(|n| is_name(n));
        let (Some(name), Some(end)) = (name, end) else {
            let shown: String = after.chars().take(40).collect();
            return Err(invalid(
                "${…}",
                format!("'${{{shown}' is not ${{NAME}} with NAME in [A-Z_][A-Z0-9_]* (write $${{ for a literal ${{)"),
            ));
        };
        let value = lookup(name)
            .ok_or_else(|| invalid(format!("${{{name}}}"), "environment variable not set"))?;
        out.push_str(&value);
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

fn is_name(n: &str) -> bool {
    let mut chars = n.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_uppercase() || c == '_')
        && chars.all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(name: &str) -> Option<String> {
        match name {
            "POD_IP" => Some("10.1.2.3".into()),
            "POD_NAME" => Some("kvmesh-0".into()),
            _ => None,
        }
    }

    #[test]
    fn variables_are_replaced_and_escapes_kept() {
        let text =
            "advertise = \"${POD_IP}:7946\"\nnode_id = \"${POD_NAME}\"\n# $${NOT} ${POD_NAME}\n";
        assert_eq!(
            expand(text, env).unwrap(),
            "advertise = \"10.1.2.3:7946\"\nnode_id = \"kvmesh-0\"\n# ${NOT} kvmesh-0\n"
        );
        assert_eq!(
            expand("no variables, $ alone", env).unwrap(),
            "no variables, $ alone"
        );
    }

    #[test]
    fn unset_and_malformed_variables_are_named() {
        let e = expand("x = \"${MISSING}\"", env).unwrap_err().to_string();
        assert!(e.contains("${MISSING}") && e.contains("not set"), "{e}");
        for bad in ["${pod_ip}", "${POD_IP", "${}", "${1X}"] {
            let e = expand(bad, env).unwrap_err().to_string();
            assert!(e.contains("NAME"), "{bad}: {e}");
        }
        let long = format!("${{{}}}", "A".repeat(200));
        assert!(expand(&long, env).is_err());
    }
}
