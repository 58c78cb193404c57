//! `jobs.toml`: reading, validating and resolving the daemon's configuration.
//!
//! This module owns the file format of docs/jobs-toml.md and
//! nothing else: it turns the text of `jobs.toml` into a [`Config`] of plain,
//! resolved values (defaults applied, `[defaults]` merged into every queue,
//! durations and sizes parsed, relative paths made relative to the directory
//! of the config file, the API token read from `token_file`), so that the rest
//! of the daemon never sees an `Option` that merely means "not written".
//!
//! Errors are for people: every [`ConfigIssue`] names the dotted key
//! (`queues.welcome.timeout`), the line and the column, and the semantic
//! checks collect *all* issues of a file instead of stopping at the first, so
//! that `khata check` can print every mistake at once. The parse happens in
//! two passes:
//!
//! 1. serde, with `deny_unknown_fields` on every raw table: unknown keys and
//!    wrong types. A serde error stops the pass; it is reported with its
//!    position, and the key is found by walking the parsed document for the
//!    innermost key or value under that position.
//! 2. semantic validation of the raw values, which keep their spans
//!    ([`toml::Spanned`]): durations, sizes, enum values, names, ranges and
//!    cross references (grants naming `[http.NAME]` providers, schedules
//!    naming queues).
//!
//! Secrets ([`Secret`]) are only shape-checked here: an environment variable
//! may well be absent while `khata check` runs. They are resolved by whoever
//! needs them, with [`Secret::resolve`].

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::ops::Range;
use std::path::{Component, Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use serde::de::{self, MapAccess, Visitor};
use toml::Spanned;

const KIB: u64 = 1024;
const MIB: u64 = 1024 * 1024;
/// The size of one WebAssembly page: the smallest memory limit that can run anything.
const WASM_PAGE: u64 = 64 * KIB;

// ---------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------

/// Every problem found in one config file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub path: PathBuf,
    pub errors: Vec<ConfigIssue>,
}

/// One problem, at one key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigIssue {
    /// Dotted, e.g. `queues.welcome.timeout`; empty when the problem has no key
    /// (a syntax error, an unreadable file).
    pub key: String,
    /// 1-based.
    pub line: Option<usize>,
    /// 1-based, in characters.
    pub column: Option<usize>,
    pub message: String,
}

impl ConfigIssue {
    /// Displays as `jobs.toml:12:11: queues.welcome.timeout: message`.
    pub fn in_file<'a>(&'a self, path: &'a Path) -> impl fmt::Display + 'a {
        IssueInFile {
            path: Some(path),
            issue: self,
        }
    }
}

struct IssueInFile<'a> {
    path: Option<&'a Path>,
    issue: &'a ConfigIssue,
}

impl fmt::Display for IssueInFile<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let issue = self.issue;
        let mut sep = "";
        if let Some(path) = self.path {
            write!(f, "{}", path.display())?;
            sep = ":";
        }
        if let Some(line) = issue.line {
            write!(f, "{sep}{line}")?;
            if let Some(column) = issue.column {
                write!(f, ":{column}")?;
            }
            sep = ":";
        }
        if !sep.is_empty() {
            f.write_str(": ")?;
        }
        if !issue.key.is_empty() {
            write!(f, "{}: ", issue.key)?;
        }
        f.write_str(&issue.message)
    }
}

/// `12:11: queues.welcome.timeout: message` (without the file; see [`ConfigIssue::in_file`]).
impl fmt::Display for ConfigIssue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        IssueInFile {
            path: None,
            issue: self,
        }
        .fmt(f)
    }
}

/// One line per issue: `jobs.toml:12:11: queues.welcome.timeout: invalid duration ...`.
impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.errors.is_empty() {
            return write!(f, "{}: invalid configuration", self.path.display());
        }
        for (i, issue) in self.errors.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            issue.in_file(&self.path).fmt(f)?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigError {}

// ---------------------------------------------------------------------------
// Loading
// ---------------------------------------------------------------------------

impl Config {
    /// Reads and parses `path`.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        match std::fs::read_to_string(path) {
            Ok(text) => Config::parse(&text, path),
            Err(e) => Err(ConfigError {
                path: path.to_path_buf(),
                errors: vec![ConfigIssue {
                    key: String::new(),
                    line: None,
                    column: None,
                    message: format!("cannot read the configuration file: {e}"),
                }],
            }),
        }
    }

    /// Parses `text`, read from `path`: `path` names the file in errors, and
    /// relative paths in the file are resolved against its directory.
    /// `daemon.token_file` is read here.
    pub fn parse(text: &str, path: &Path) -> Result<Config, ConfigError> {
        let mut checker = Checker::new(text, path);
        let config = checker.deserialize().map(|raw| checker.resolve(raw));
        let mut issues = checker.issues;
        match config {
            Some(config) if issues.is_empty() => Ok(config),
            _ => {
                // By position; issues without one (there are none today) last.
                issues.sort_by_key(|i| (i.line.is_none(), i.line, i.column));
                Err(ConfigError {
                    path: path.to_path_buf(),
                    errors: issues,
                })
            }
        }
    }

    /// The queue called `name`.
    pub fn queue(&self, name: &str) -> Option<&Queue> {
        self.queues.get(name)
    }
}

mod check;
mod model;
mod raw;
mod sections;
mod values;

use self::check::*;
pub use self::model::*;
use self::raw::*;
use self::values::*;

#[cfg(test)]
mod tests;
