//! The combined filter's plugin configuration: one JSON object with a section per stage.
//!
//! ```json
//! {"session": {}, "admission": {"endpoints": 2}, "prefix_affinity": {"endpoints": [...]}}
//! ```
//!
//! Each section is that stage's own configuration, exactly as the separate filter takes it
//! (checked by the stage, unknown fields refused); a missing (or `null`) section turns its
//! stage off. `prefix_affinity` is required: it is the stage that routes, and without it the
//! session pin would have no taker and nothing would set the destination (for admission alone,
//! run the `kvoy_admission` filter). An unknown top-level key is refused by name.

use serde::Deserialize;
use serde_json::value::RawValue;
use thiserror::Error;

/// The configuration as written: each section's JSON text, unparsed (the stage checks it, and
/// its shared-data namespace is derived from exactly these bytes).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig<'a> {
    #[serde(borrow, default)]
    session: Option<&'a RawValue>,
    #[serde(borrow, default)]
    admission: Option<&'a RawValue>,
    #[serde(borrow, default)]
    prefix_affinity: Option<&'a RawValue>,
}

/// The sections of a checked top level, each the JSON text of its stage's configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sections<'a> {
    pub session: Option<&'a [u8]>,
    pub admission: Option<&'a [u8]>,
    pub prefix_affinity: &'a [u8],
}

/// Why the top level was refused (a section's own errors come from its stage).
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("the plugin configuration is empty; it needs at least a `prefix_affinity` section")]
    Empty,
    #[error("the plugin configuration is not a JSON object with the sections `session`, `admission`, `prefix_affinity`: {0}")]
    Json(String),
    #[error("`prefix_affinity` is required: it is the stage that routes (for admission or sessions alone, run the kvoy_admission or kvoy_session filter)")]
    NoRouting,
}

fn section(raw: Option<&RawValue>) -> Option<&[u8]> {
    raw.map(|r| r.get().as_bytes())
        .filter(|s| s.trim_ascii() != b"null")
}

/// Splits the plugin configuration into its sections.
pub fn sections(raw: &[u8]) -> Result<Sections<'_>, ConfigError> {
    if raw.iter().all(u8::is_ascii_whitespace) {
        return Err(ConfigError::Empty);
    }
    // serde would also read a struct from an array (`[{...}]`): only an object is one.
    if raw.trim_ascii_start().first() != Some(&b'{') {
        return Err(ConfigError::Json("expected a JSON object".to_owned()));
    }
    let config: RawConfig<'_> =
        serde_json::from_slice(raw).map_err(|e| ConfigError::Json(e.to_string()))?;
    let prefix_affinity = section(config.prefix_affinity).ok_or(ConfigError::NoRouting)?;
    Ok(Sections {
        session: section(config.session),
        admission: section(config.admission),
        prefix_affinity,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn sections_are_passed_on_as_written() {
        let raw = br#"{"session": {"ttl_ms": 5},
                       "prefix_affinity": {"endpoints": []}, "admission": null}"#;
        let s = sections(raw).unwrap();
        assert_eq!(s.session, Some(br#"{"ttl_ms": 5}"#.as_slice()));
        assert_eq!(s.admission, None);
        assert_eq!(s.prefix_affinity, br#"{"endpoints": []}"#);
    }

    #[test]
    fn refusals_say_why() {
        let e = sections(br#"{"prefix_affinity": {}, "sesion": {}}"#).unwrap_err();
        assert!(e.to_string().contains("`sesion`"), "{e}");
        assert_eq!(sections(br#"{"session": {}}"#), Err(ConfigError::NoRouting));
        assert_eq!(
            sections(br#"{"prefix_affinity": null}"#),
            Err(ConfigError::NoRouting)
        );
        assert_eq!(sections(b"  "), Err(ConfigError::Empty));
        assert!(matches!(sections(b"[1]"), Err(ConfigError::Json(_))));
    }
}
