//! Reading ferroccl's environment variables (`FERROCCL_*`, and NCCL's names where they
//! mean the same thing): the bottom layer every module may use. Every variable the code
//! reads is listed in the book's reference (`docs/src/environment.md`, checked by
//! `tests/docs.rs`).

use crate::error::{Error, Result};

/// The first of `names` that is set, and its value.
pub fn env_first<'a>(names: &[&'a str]) -> Option<(&'a str, String)> {
    names
        .iter()
        .find_map(|&name| std::env::var(name).ok().map(|value| (name, value)))
}

/// The first of `names` that is set, read as a positive number (an error names the
/// variable otherwise).
pub fn env_number(names: &[&str]) -> Result<Option<f64>> {
    let Some((name, text)) = env_first(names) else {
        return Ok(None);
    };
    let v: f64 = text.trim().parse().map_err(|_| Error::Env {
        var: name.to_string(),
        detail: format!("{text:?} is not a number"),
    })?;
    if !(v.is_finite() && v > 0.0) {
        return Err(Error::Env {
            var: name.to_string(),
            detail: format!("{text:?} must be positive"),
        });
    }
    Ok(Some(v))
}
