//! Logging and tracing.
//!
//! ferroccl logs through `tracing` and is quiet by default. `FERROCCL_DEBUG` (or
//! `NCCL_DEBUG`, honoured for familiarity) selects the level: `WARN`, `INFO`, `DEBUG`
//! or `TRACE`; `VERSION` is treated as `INFO`. Applications that install their own
//! `tracing` subscriber (before their first communicator, which installs ferroccl's
//! when one of these variables is set) get ferroccl's events there instead.
//!
//! **Traces of real runs.** With `FERROCCL_TRACE=DIR`, every rank writes what it did to
//! `DIR/rank<R>.<pid>.jsonl`, one JSON object a line: a `collective` record per call
//! (`op`, `seq`, `bytes`, `algorithm`, `start_us`, `end_us`) and a `step` record per
//! plan step (`seq`, `lane`, `channel`, `index`, `step`, `from`, `to`, `bytes`,
//! `by_sender`: whether the sender wrote the step's destination itself, single copy's
//! write-back; `start_us`, `end_us`; times in microseconds since the Unix epoch, so ranks of one
//! host line up). They are `tracing` spans and events with target [`TRACE_TARGET`];
//! when no trace is being written the engine does not even read the clock.
//! `ferroccl-viz trace DIR` turns them into a timeline and a Chrome/Perfetto trace.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::PathBuf;
use std::sync::{Mutex, Once};
use std::time::{SystemTime, UNIX_EPOCH};

use tracing::field::{Field, Visit};
use tracing::level_filters::LevelFilter;
use tracing::span::{Attributes, Id};
use tracing::{Event, Subscriber};
use tracing_subscriber::Layer;
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::util::SubscriberInitExt;

/// The `tracing` target of trace records (collective spans and step events).
pub const TRACE_TARGET: &str = "ferroccl::trace";

/// Microseconds since the Unix epoch, now.
pub fn now_us() -> u64 {
    epoch_us(SystemTime::now())
}

/// Microseconds from the Unix epoch to `t` (0 before it).
pub fn epoch_us(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// Whether trace records are being written (so the engine should time its steps).
pub fn tracing_steps() -> bool {
    tracing::enabled!(target: TRACE_TARGET, tracing::Level::TRACE)
}

/// Collects a span's or event's fields as the members of a JSON object (written by
/// hand: a trace record should cost little more than the formatting of its numbers).
#[derive(Default)]
struct Fields {
    json: String,
    rank: u64,
}

impl Fields {
    fn key(&mut self, field: &Field) {
        use std::fmt::Write as _;
        let _ = write!(
            self.json,
            "{}\"{}\":",
            if self.json.is_empty() { "" } else { "," },
            field.name()
        );
    }

    fn text(&mut self, field: &Field, value: &str) {
        self.key(field);
        self.json
            .push_str(&serde_json::Value::from(value).to_string());
    }
}

impl Visit for Fields {
    fn record_u64(&mut self, field: &Field, value: u64) {
        use std::fmt::Write as _;
        if field.name() == "rank" {
            self.rank = value;
        }
        self.key(field);
        let _ = write!(self.json, "{value}");
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        use std::fmt::Write as _;
        if field.name() == "rank" {
            self.rank = value.max(0) as u64;
        }
        self.key(field);
        let _ = write!(self.json, "{value}");
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        use std::fmt::Write as _;
        self.key(field);
        let _ = write!(self.json, "{value}");
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.text(field, value);
    }
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() != "message" {
            self.text(field, &format!("{value:?}"));
        }
    }
}

/// Writes trace records to one file per rank.
struct TraceWriter {
    dir: PathBuf,
    files: Mutex<HashMap<u64, BufWriter<File>>>,
    open: Mutex<HashMap<Id, (Fields, u64)>>,
}

impl TraceWriter {
    fn write(&self, kind: &str, fields: &Fields, extra: &str, flush: bool) {
        let mut files = crate::lock(&self.files);
        let file = files.entry(fields.rank).or_insert_with(|| {
            let path = self
                .dir
                .join(format!("rank{}.{}.jsonl", fields.rank, std::process::id()));
            match File::create(&path) {
                Ok(f) => BufWriter::new(f),
                Err(e) => {
                    eprintln!(
                        "ferroccl: FERROCCL_TRACE: cannot create {}: {e}",
                        path.display()
                    );
                    BufWriter::new(File::create("/dev/null").expect("/dev/null"))
                }
            }
        });
        let _ = writeln!(file, "{{\"kind\":\"{kind}\",{}{extra}}}", fields.json);
        if flush {
            let _ = file.flush();
        }
    }
}

impl<S: Subscriber> Layer<S> for TraceWriter {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, _ctx: Context<'_, S>) {
        if attrs.metadata().target() != TRACE_TARGET {
            return;
        }
        let mut f = Fields::default();
        attrs.record(&mut f);
        crate::lock(&self.open).insert(id.clone(), (f, now_us()));
    }

    fn on_close(&self, id: Id, _ctx: Context<'_, S>) {
        let Some((f, start)) = crate::lock(&self.open).remove(&id) else {
            return;
        };
        let times = format!(",\"start_us\":{start},\"end_us\":{}", now_us());
        self.write("collective", &f, &times, true);
    }

    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        if event.metadata().target() != TRACE_TARGET {
            return;
        }
        let mut f = Fields::default();
        event.record(&mut f);
        self.write("step", &f, "", false);
    }
}

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

/// Installs, once per process, a stderr logger at the level named by `FERROCCL_DEBUG`
/// / `NCCL_DEBUG` and the trace writer when `FERROCCL_TRACE` names a directory. Does
/// nothing when none is set or another subscriber is installed.
pub fn init_from_env() {
    static INIT: Once = Once::new();
    INIT.call_once(|| {
        let level = crate::env::env_first(&["FERROCCL_DEBUG", "NCCL_DEBUG"]).map(|(var, value)| {
            parse_level(&value).unwrap_or_else(|| {
                eprintln!(
                    "ferroccl: {var}={value:?} is not one of WARN, INFO, DEBUG, TRACE; \
                         using WARN"
                );
                LevelFilter::WARN
            })
        });
        let trace_dir = std::env::var_os("FERROCCL_TRACE")
            .filter(|d| !d.is_empty())
            .map(PathBuf::from)
            .filter(|dir| match std::fs::create_dir_all(dir) {
                Ok(()) => true,
                Err(e) => {
                    eprintln!(
                        "ferroccl: FERROCCL_TRACE={}: {e}; not tracing",
                        dir.display()
                    );
                    false
                }
            });
        if level.is_none() && trace_dir.is_none() {
            return;
        }
        let log = level.map(|level| {
            tracing_subscriber::fmt::layer()
                .with_writer(std::io::stderr)
                .with_target(false)
                .with_filter(tracing_subscriber::filter::filter_fn(move |m| {
                    m.target() != TRACE_TARGET && *m.level() <= level
                }))
        });
        let trace = trace_dir.map(|dir| {
            TraceWriter {
                dir,
                files: Mutex::new(HashMap::new()),
                open: Mutex::new(HashMap::new()),
            }
            .with_filter(tracing_subscriber::filter::filter_fn(|m| {
                m.target() == TRACE_TARGET
            }))
        });
        let _ = tracing_subscriber::registry()
            .with(log)
            .with(trace)
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
