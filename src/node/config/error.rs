//! A configuration that cannot be used, naming the key at fault.

use std::path::PathBuf;

/// A configuration that cannot be used, naming the key at fault.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The TOML is malformed, has an unknown key or a value of the wrong type (the message names
    /// the key).
    #[error("invalid config{}: {message}", origin.as_ref().map(|p| format!(" in {}", p.display())).unwrap_or_default())]
    Parse {
        /// The file, when read from one.
        origin: Option<PathBuf>,
        /// The parser's message, which names the key.
        message: String,
    },
    /// A value is out of range or inconsistent.
    #[error("invalid config: {key}: {message}")]
    Invalid {
        /// The dotted key, e.g. `replicas[1].url`.
        key: String,
        /// What is wrong with it.
        message: String,
    },
}

pub(super) fn invalid(key: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.into(),
        message: message.into(),
    }
}
