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

/// An on/off variable: `None` where unset, an error naming it where it is neither.
pub fn env_switch(var: &str) -> Result<Option<bool>> {
    std::env::var(var).ok().map(|v| switch(var, &v)).transpose()
}

/// The value `v` of the on/off variable `var`.
fn switch(var: &str, v: &str) -> Result<bool> {
    match v.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "" | "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(Error::Env {
            var: var.into(),
            detail: format!("{v:?} is not 1 or 0"),
        }),
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_switch_reads_the_usual_spellings_and_names_itself_otherwise() {
        for on in ["1", "true", " YES ", "On"] {
            assert!(switch("SOME_SWITCH", on).unwrap(), "{on:?}");
        }
        for off in ["", "0", "false", "no", "OFF"] {
            assert!(!switch("SOME_SWITCH", off).unwrap(), "{off:?}");
        }
        let e = switch("SOME_SWITCH", "maybe").unwrap_err().to_string();
        assert!(
            e.contains("SOME_SWITCH") && e.contains("\"maybe\" is not 1 or 0"),
            "{e}"
        );
    }
}
