//! The checks of single values (durations, sizes, numbers, choices, names,
//! secrets), and the helpers that find a key's place in the file.

use super::*;

impl<'a> Checker<'a> {
    pub(super) fn duration(
        &mut self,
        key: &str,
        raw: Option<&Spanned<String>>,
        positive: bool,
    ) -> Option<Duration> {
        let raw = raw?;
        match humantime::parse_duration(raw.get_ref().trim()) {
            Ok(d) if positive && d.is_zero() => {
                self.issue(key, Some(raw.span()), "must be longer than zero");
                None
            }
            Ok(d) => Some(d),
            Err(e) => {
                self.issue(
                    key,
                    Some(raw.span()),
                    format!(
                        "invalid duration {:?}: {e} (write e.g. \"500ms\", \"30s\", \"10m\", \"1h\", \"7d\")",
                        raw.get_ref()
                    ),
                );
                None
            }
        }
    }

    pub(super) fn size(
        &mut self,
        key: &str,
        raw: Option<&Spanned<RawSize>>,
        min: u64,
    ) -> Option<u64> {
        let raw = raw?;
        let bytes = match raw.get_ref() {
            RawSize::Bytes(n) => match u64::try_from(*n) {
                Ok(n) => n,
                Err(_) => {
                    self.issue(key, Some(raw.span()), format!("invalid size {n}: negative"));
                    return None;
                }
            },
            RawSize::Text(text) => match text.trim().parse::<bytesize::ByteSize>() {
                Ok(size) => size.as_u64(),
                Err(e) => {
                    self.issue(
                        key,
                        Some(raw.span()),
                        format!(
                            "invalid size {text:?}: {e} (write e.g. \"64MiB\", \"512KiB\" or a number of bytes)"
                        ),
                    );
                    return None;
                }
            },
        };
        if bytes < min {
            let message = if min == WASM_PAGE {
                format!(
                    "{bytes} bytes is less than one WebAssembly page; must be at least {min} bytes (64KiB)"
                )
            } else {
                format!("must be at least {min} byte(s), got {bytes}")
            };
            self.issue(key, Some(raw.span()), message);
            return None;
        }
        Some(bytes)
    }

    pub(super) fn int(
        &mut self,
        key: &str,
        raw: Option<&Spanned<RawInt>>,
        min: i64,
        max: i64,
    ) -> Option<i64> {
        let raw = raw?;
        let value = raw.get_ref().0;
        if value < min || value > max {
            self.issue(
                key,
                Some(raw.span()),
                format!("must be between {min} and {max}, got {value}"),
            );
            return None;
        }
        Some(value)
    }

    pub(super) fn float(
        &mut self,
        key: &str,
        raw: Option<&Spanned<RawFloat>>,
        ok: impl Fn(f64) -> bool,
        requirement: &str,
    ) -> Option<f64> {
        let raw = raw?;
        let value = raw.get_ref().0;
        if !value.is_finite() || !ok(value) {
            self.issue(key, Some(raw.span()), format!("{requirement}, got {value}"));
            return None;
        }
        Some(value)
    }

    pub(super) fn choice<T: Copy>(
        &mut self,
        key: &str,
        raw: Option<&Spanned<String>>,
        options: &[(&str, T)],
    ) -> Option<T> {
        let raw = raw?;
        match options.iter().find(|(name, _)| *name == raw.get_ref()) {
            Some((_, value)) => Some(*value),
            None => {
                let expected: Vec<String> = options
                    .iter()
                    .map(|(name, _)| format!("{name:?}"))
                    .collect();
                self.issue(
                    key,
                    Some(raw.span()),
                    format!(
                        "unknown value {:?}; expected one of {}",
                        raw.get_ref(),
                        expected.join(", ")
                    ),
                );
                None
            }
        }
    }

    /// Queue, plugin, namespace, provider, schedule and collection names:
    /// `[A-Za-z0-9_-]`, 1 to 64 characters.
    pub(super) fn name(&mut self, key: &str, what: &str, raw: &Spanned<String>) -> bool {
        if valid_name(raw.get_ref()) {
            return true;
        }
        self.issue(
            key,
            Some(raw.span()),
            format!(
                "invalid {what} {:?}: use 1 to 64 of the characters A-Z a-z 0-9 _ -",
                raw.get_ref()
            ),
        );
        false
    }

    pub(super) fn header_name(&mut self, key: &str, raw: &Spanned<String>) -> bool {
        let is_tchar = |c: char| c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c);
        let name = raw.get_ref();
        if !name.is_empty() && name.chars().all(is_tchar) {
            return true;
        }
        self.issue(
            key,
            Some(raw.span()),
            format!("{name:?} is not a valid HTTP header name"),
        );
        false
    }

    pub(super) fn secret(&mut self, key: &str, raw: &Spanned<RawSecret>) -> Option<Secret> {
        let table = match raw.get_ref() {
            RawSecret::Plain(value) => return Some(Secret::Plain(value.clone())),
            RawSecret::Table(table) => table,
        };
        let prefix = table
            .prefix
            .as_ref()
            .map(|p| p.get_ref().clone())
            .unwrap_or_default();
        match (&table.env, &table.file) {
            (Some(var), None) => {
                let name = var.get_ref();
                if name.is_empty() || name.contains(['=', '\0']) {
                    self.issue(
                        &join(key, "env"),
                        Some(var.span()),
                        format!("{name:?} is not a valid environment variable name"),
                    );
                    return None;
                }
                Some(Secret::Env {
                    var: name.clone(),
                    prefix,
                })
            }
            (None, Some(file)) => {
                if file.get_ref().trim().is_empty() {
                    self.issue(&join(key, "file"), Some(file.span()), "the path is empty");
                    return None;
                }
                Some(Secret::File {
                    path: resolve_path(&self.base_dir, file.get_ref()),
                    prefix,
                })
            }
            (Some(_), Some(file)) => {
                self.issue(
                    &join(key, "file"),
                    Some(file.span()),
                    "give either `env` or `file`, not both",
                );
                None
            }
            (None, None) => {
                self.issue(
                    key,
                    Some(raw.span()),
                    "a secret table needs `env = \"VAR\"` or `file = \"/path\"`",
                );
                None
            }
        }
    }
}

pub(super) fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

/// `base/p`, or `p` when absolute; without `.` components.
pub(super) fn resolve_path(base: &Path, path: &str) -> PathBuf {
    let path = Path::new(path);
    let joined = if path.is_absolute() {
        path.to_path_buf()
    } else {
        base.join(path)
    };
    let cleaned: PathBuf = joined
        .components()
        .filter(|c| !matches!(c, Component::CurDir))
        .collect();
    if cleaned.as_os_str().is_empty() {
        PathBuf::from(".")
    } else {
        cleaned
    }
}

/// A key as TOML would write it: bare when it can be, quoted otherwise.
pub(super) fn quote_key(key: &str) -> String {
    let bare = !key.is_empty()
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if bare {
        key.to_owned()
    } else {
        let mut quoted = String::from("\"");
        for c in key.chars() {
            match c {
                '"' => quoted.push_str("\\\""),
                '\\' => quoted.push_str("\\\\"),
                c if c.is_control() => quoted.push_str(&format!("\\u{:04X}", u32::from(c))),
                c => quoted.push(c),
            }
        }
        quoted.push('"');
        quoted
    }
}

/// `parent.child`, quoting `child` when needed.
pub(super) fn join(parent: &str, child: &str) -> String {
    if parent.is_empty() {
        quote_key(child)
    } else {
        format!("{parent}.{}", quote_key(child))
    }
}

/// The dotted path of the innermost key or value of `document` at byte
/// `offset` (for serde errors, which carry a position but no key).
pub(super) fn key_at(document: &toml::de::DeTable<'_>, offset: usize) -> String {
    let mut best: Option<(usize, String)> = None;
    let mut path = String::new();
    walk_table(document, offset, &mut path, &mut best);
    best.map(|(_, key)| key).unwrap_or_default()
}

pub(super) fn walk_table(
    table: &toml::de::DeTable<'_>,
    offset: usize,
    path: &mut String,
    best: &mut Option<(usize, String)>,
) {
    for (key, value) in table.iter() {
        let saved = path.len();
        let segment = quote_key(key.get_ref());
        if path.is_empty() {
            path.push_str(&segment);
        } else {
            path.push('.');
            path.push_str(&segment);
        }
        consider(key.span(), offset, path, best);
        walk_value(value, offset, path, best);
        path.truncate(saved);
    }
}

pub(super) fn walk_value(
    value: &Spanned<toml::de::DeValue<'_>>,
    offset: usize,
    path: &mut String,
    best: &mut Option<(usize, String)>,
) {
    consider(value.span(), offset, path, best);
    match value.get_ref() {
        toml::de::DeValue::Table(table) => walk_table(table, offset, path, best),
        toml::de::DeValue::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                let saved = path.len();
                path.push_str(&format!("[{i}]"));
                walk_value(item, offset, path, best);
                path.truncate(saved);
            }
        }
        _ => {}
    }
}

/// Keeps the smallest span around `offset`; on a tie, the deeper (later) path.
pub(super) fn consider(
    span: Range<usize>,
    offset: usize,
    path: &str,
    best: &mut Option<(usize, String)>,
) {
    let contains = span.contains(&offset) || (span.is_empty() && span.start == offset);
    if !contains {
        return;
    }
    let len = span.len();
    if best.as_ref().is_none_or(|(best_len, _)| len <= *best_len) {
        *best = Some((len, path.to_owned()));
    }
}

/// A TOML table as JSON. Datetimes become their RFC 3339 strings; floats
/// that JSON cannot hold (NaN, infinities) are errors.
pub(super) fn table_to_json(table: &toml::Table) -> Result<serde_json::Value, String> {
    let mut object = serde_json::Map::new();
    for (key, value) in table {
        object.insert(key.clone(), value_to_json(value)?);
    }
    Ok(serde_json::Value::Object(object))
}

pub(super) fn value_to_json(value: &toml::Value) -> Result<serde_json::Value, String> {
    Ok(match value {
        toml::Value::String(s) => serde_json::Value::String(s.clone()),
        toml::Value::Integer(i) => serde_json::Value::from(*i),
        toml::Value::Float(f) => match serde_json::Number::from_f64(*f) {
            Some(n) => serde_json::Value::Number(n),
            None => return Err(format!("{f} cannot be represented in JSON")),
        },
        toml::Value::Boolean(b) => serde_json::Value::Bool(*b),
        toml::Value::Datetime(dt) => serde_json::Value::String(dt.to_string()),
        toml::Value::Array(items) => serde_json::Value::Array(
            items
                .iter()
                .map(value_to_json)
                .collect::<Result<Vec<_>, _>>()?,
        ),
        toml::Value::Table(table) => table_to_json(table)?,
    })
}
