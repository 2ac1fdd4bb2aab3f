//! The files kvoy-local reads (its configuration, request files): read whole, then parsed as JSON
//! when the name ends in `.json` and as YAML otherwise. One home for the errors they share.

use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;

/// Why a file could not be read or parsed.
#[derive(Debug, thiserror::Error)]
pub enum DocumentError {
    #[error("reading {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: {message}", path.display())]
    Syntax { path: PathBuf, message: String },
}

/// The text of the file at `path`.
pub fn read(path: &Path) -> Result<String, DocumentError> {
    std::fs::read_to_string(path).map_err(|source| DocumentError::Read {
        path: path.to_owned(),
        source,
    })
}

/// `text` parsed as JSON if `json`, else as YAML; `path` names the file in the error.
pub fn parse<T: DeserializeOwned>(text: &str, json: bool, path: &Path) -> Result<T, DocumentError> {
    let parsed = if json {
        serde_json::from_str(text).map_err(|e| e.to_string())
    } else {
        serde_yaml_ng::from_str(text).map_err(|e| e.to_string())
    };
    parsed.map_err(|message| DocumentError::Syntax {
        path: path.to_owned(),
        message,
    })
}

/// Whether `path` names a JSON file (else it is read as YAML).
pub fn is_json(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "json")
}
