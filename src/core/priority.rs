//! Priority classes: which class a request waits in when no replica has room, and what that
//! class may ask of the admission queue (`admission.rs`).
//!
//! Classes are configured in priority order (the first is the highest); each has a weight (its
//! share of freed slots against the other classes' waiting requests), a bound on how many of its
//! requests may wait, and the longest a request of it may wait. A request's class comes from its
//! tenant's `priority`; a request header may name another class, but only one at or below the
//! tenant's ceiling (`max_priority`, else its own `priority`): a client can lower its priority,
//! say to keep a background job from competing with its own interactive traffic, but never
//! promote itself past what the operator gave its tenant. An unknown class name in the header
//! is ignored (the tenant's class applies), so a typo cannot fail a request.

use serde::Deserialize;

/// Most classes a configuration may define (class ids are small and fixed per configuration).
pub const MAX_CLASSES: usize = 8;
/// Bounds of a class or tenant weight: a freed slot is worth `1 / weight` virtual time, so the
/// ratio of the extremes bounds how unequal two flows' shares can be.
pub const MIN_WEIGHT: f64 = 0.01;
/// See [`MIN_WEIGHT`].
pub const MAX_WEIGHT: f64 = 1000.0;
/// Largest `max_queue` of one class.
pub const MAX_QUEUE: usize = 65_536;
/// Largest `max_wait_ms` of one class: 10 minutes (a client waiting longer has given up).
pub const MAX_WAIT_MS: u64 = 600_000;

/// One priority class.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClassConfig {
    /// Name, as tenants' `priority` and the priority header name it (≤ 64 bytes, unique).
    pub name: String,
    /// Share of freed slots against other waiting flows: a flow (class, tenant) is served in
    /// proportion to this times its tenant's `weight`. In [`MIN_WEIGHT`, `MAX_WEIGHT`].
    /// Default 1.
    #[serde(default = "default_weight")]
    pub weight: f64,
    /// Most requests of this class waiting at once (at this node); one more is refused at once
    /// with 429 and `Retry-After`. In 0..=[`MAX_QUEUE`] (0: never waits). Default 256.
    #[serde(default = "default_max_queue")]
    pub max_queue: usize,
    /// Longest a request of this class waits for a slot (ms); one whose predicted wait is longer
    /// is refused at once, one still waiting then is refused, both with 429 and `Retry-After`.
    /// In 1..=[`MAX_WAIT_MS`]. Default 10,000.
    #[serde(default = "default_max_wait_ms")]
    pub max_wait_ms: u64,
}

fn default_weight() -> f64 {
    1.0
}

fn default_max_queue() -> usize {
    256
}

fn default_max_wait_ms() -> u64 {
    10_000
}

impl ClassConfig {
    /// A class named `name` with the given weight, queue bound and wait bound.
    pub fn new(name: &str, weight: f64, max_queue: usize, max_wait_ms: u64) -> Self {
        ClassConfig {
            name: name.to_owned(),
            weight,
            max_queue,
            max_wait_ms,
        }
    }

    /// The classes used when the configuration names none: `critical` (weight 16, waits up to
    /// 5 s), `standard` (weight 4, 10 s) and `batch` (weight 1, 30 s, the longest queue).
    pub fn defaults() -> Vec<ClassConfig> {
        vec![
            ClassConfig::new("critical", 16.0, 256, 5_000),
            ClassConfig::new("standard", 4.0, 512, 10_000),
            ClassConfig::new("batch", 1.0, 1024, 30_000),
        ]
    }

    /// Checks one class against its bounds: `Err((field, message))`.
    pub fn validate(&self) -> Result<(), (&'static str, &'static str)> {
        if self.name.is_empty() || self.name.len() > 64 {
            return Err(("name", "must be 1 to 64 bytes"));
        }
        if !(MIN_WEIGHT..=MAX_WEIGHT).contains(&self.weight) {
            return Err(("weight", "must be in [0.01, 1000]"));
        }
        if self.max_queue > MAX_QUEUE {
            return Err(("max_queue", "must be at most 65536"));
        }
        if !(1..=MAX_WAIT_MS).contains(&self.max_wait_ms) {
            return Err(("max_wait_ms", "must be in 1..=600000"));
        }
        Ok(())
    }
}

/// The `[priorities]` section: classes, the default class and the header that may lower it.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PrioritiesConfig {
    /// Request header naming a class (at or below the tenant's ceiling). Default
    /// `x-kvmesh-priority`.
    pub header: String,
    /// Class of requests whose tenant names none. Default `standard`.
    pub default_class: String,
    /// Classes, highest priority first (1 to [`MAX_CLASSES`], unique names). Default
    /// [`ClassConfig::defaults`].
    pub classes: Vec<ClassConfig>,
}

impl Default for PrioritiesConfig {
    fn default() -> Self {
        PrioritiesConfig {
            header: "x-kvmesh-priority".into(),
            default_class: "standard".into(),
            classes: ClassConfig::defaults(),
        }
    }
}

impl PrioritiesConfig {
    /// Checks the section: `Err((key under [priorities], message))`.
    pub fn validate(&self) -> Result<(), (String, String)> {
        if self.classes.is_empty() || self.classes.len() > MAX_CLASSES {
            return Err(("classes".into(), "must list 1 to 8 classes".into()));
        }
        for (n, c) in self.classes.iter().enumerate() {
            c.validate()
                .map_err(|(field, msg)| (format!("classes[{n}].{field}"), msg.to_owned()))?;
            if self.classes[..n].iter().any(|o| o.name == c.name) {
                return Err((format!("classes[{n}].name"), "must be unique".into()));
            }
        }
        if class_by_name(&self.classes, &self.default_class).is_none() {
            return Err((
                "default_class".into(),
                "must name one of the classes".into(),
            ));
        }
        if self.header.is_empty()
            || !self
                .header
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return Err((
                "header".into(),
                "must be a header name (letters, digits, '-', '_')".into(),
            ));
        }
        Ok(())
    }

    /// The default class's id (the first class if the name is unknown: validated away).
    pub fn default_id(&self) -> ClassId {
        class_by_name(&self.classes, &self.default_class).unwrap_or(ClassId(0))
    }
}

/// A class by its position in the configured list (0 is the highest priority).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ClassId(pub u8);

impl ClassId {
    /// Its index in the class list.
    pub fn index(self) -> usize {
        usize::from(self.0)
    }
}

/// The position of the class named `name` in `classes`.
pub fn class_by_name(classes: &[ClassConfig], name: &str) -> Option<ClassId> {
    classes
        .iter()
        .take(MAX_CLASSES)
        .position(|c| c.name == name)
        .and_then(|p| u8::try_from(p).ok())
        .map(ClassId)
}

/// The class a request waits in: the header's class when it is known and not above the
/// tenant's ceiling (`max_priority`, else `priority`, else `default`), else the tenant's own
/// class (`priority`, else `default`), never above the ceiling. Unknown names count as absent.
pub fn resolve(
    classes: &[ClassConfig],
    default: ClassId,
    tenant_priority: Option<&str>,
    tenant_max_priority: Option<&str>,
    header: Option<&str>,
) -> ClassId {
    let named = |n: Option<&str>| n.and_then(|n| class_by_name(classes, n));
    let own = named(tenant_priority).unwrap_or(default);
    // A lower id is a higher priority; the ceiling is never below the tenant's own class.
    let ceiling = named(tenant_max_priority).map_or(own, |c| c.min(own));
    match named(header) {
        Some(asked) => asked.max(ceiling),
        None => own,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_header_lowers_priority_but_never_lifts_it_past_the_tenants_ceiling() {
        let classes = ClassConfig::defaults();
        let c = |n| class_by_name(&classes, n).unwrap_or(ClassId(99));
        let (critical, standard, batch) = (c("critical"), c("standard"), c("batch"));
        // No tenant class: the default; a header may lower it, not raise it.
        assert_eq!(resolve(&classes, standard, None, None, None), standard);
        assert_eq!(
            resolve(&classes, standard, None, None, Some("batch")),
            batch
        );
        assert_eq!(
            resolve(&classes, standard, None, None, Some("critical")),
            standard,
            "a client cannot promote itself"
        );
        // A batch tenant stays batch whatever it asks.
        assert_eq!(
            resolve(&classes, standard, Some("batch"), None, Some("critical")),
            batch
        );
        // A tenant allowed up to critical runs standard by default and may ask for critical.
        let t = (Some("standard"), Some("critical"));
        assert_eq!(resolve(&classes, batch, t.0, t.1, None), standard);
        assert_eq!(
            resolve(&classes, batch, t.0, t.1, Some("critical")),
            critical
        );
        assert_eq!(resolve(&classes, batch, t.0, t.1, Some("batch")), batch);
        // Unknown names are ignored, never an error.
        assert_eq!(
            resolve(&classes, standard, Some("gold"), None, Some("platinum")),
            standard
        );
        // A ceiling below the tenant's own class does not demote it.
        assert_eq!(
            resolve(&classes, batch, Some("critical"), Some("batch"), None),
            critical
        );
    }

    #[test]
    fn classes_are_checked_against_their_bounds() {
        assert!(ClassConfig::defaults().iter().all(|c| c.validate().is_ok()));
        let bad = |c: ClassConfig| c.validate().err().map(|e| e.0);
        assert_eq!(bad(ClassConfig::new("", 1.0, 1, 1)), Some("name"));
        assert_eq!(bad(ClassConfig::new("x", 0.0, 1, 1)), Some("weight"));
        assert_eq!(
            bad(ClassConfig::new("x", 1.0, MAX_QUEUE + 1, 1)),
            Some("max_queue")
        );
        assert_eq!(bad(ClassConfig::new("x", 1.0, 1, 0)), Some("max_wait_ms"));
        assert_eq!(bad(ClassConfig::new("x", 1.0, 0, MAX_WAIT_MS)), None);
    }
}
