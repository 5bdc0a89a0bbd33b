//! Logging and tracing.
//!
//! ferroccl logs through `tracing` and is quiet by default. `FERROCCL_DEBUG` (or
//! `NCCL_DEBUG`, honoured for familiarity) selects the level: `WARN`, `INFO`, `DEBUG`
//! or `TRACE`; `VERSION` is treated as `INFO`. Applications that install their own
//! `tracing` subscriber get ferroccl's events there instead.

use std::sync::Once;

use tracing::level_filters::LevelFilter;

/// Parses a `FERROCCL_DEBUG` value into a level (`None` for unknown values).
pub fn parse_level(value: &str) -> Option<LevelFilter> {
    match value.trim().to_ascii_uppercase().as_str() {
        "" | "OFF" | "NONE" => Some(LevelFilter::OFF),
        "ERROR" => Some(LevelFilter::ERROR),
        "WARN" => Some(LevelFilter::WARN),
        "INFO" | "VERSION" => Some(LevelFilter::INFO),
        "DEBUG" => Some(LevelFilter::DEBUG),
        "TRACE" => Some(LevelFilter::TRACE),
        _ => None,
    }
}

/// Installs a stderr logger at the level named by `FERROCCL_DEBUG` / `NCCL_DEBUG`, once
/// per process. Does nothing when neither is set or another subscriber is installed.
pub fn init_from_env() {
    static INIT: Once = Once::new();
    INIT.call_once(|| {
        let Some((var, value)) = ["FERROCCL_DEBUG", "NCCL_DEBUG"]
            .iter()
            .find_map(|v| std::env::var(v).ok().map(|val| (*v, val)))
        else {
            return;
        };
        let level = parse_level(&value).unwrap_or_else(|| {
            eprintln!(
                "ferroccl: {var}={value:?} is not one of WARN, INFO, DEBUG, TRACE; using WARN"
            );
            LevelFilter::WARN
        });
        let _ = tracing_subscriber::fmt()
            .with_max_level(level)
            .with_writer(std::io::stderr)
            .with_target(false)
            .try_init();
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_parse_like_nccl_debug() {
        assert_eq!(parse_level("info"), Some(LevelFilter::INFO));
        assert_eq!(parse_level("VERSION"), Some(LevelFilter::INFO));
        assert_eq!(parse_level("TRACE"), Some(LevelFilter::TRACE));
        assert_eq!(parse_level("loud"), None);
    }
}
