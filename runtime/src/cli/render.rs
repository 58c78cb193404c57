//! Human output: the API's answers as tables and fields.

use super::*;

// ---------------------------------------------------------------------------
// Human output

pub(super) fn pretty(value: &Value) -> String {
    // Serializing a `Value` cannot fail.
    serde_json::to_string_pretty(value).unwrap_or_default() + "\n"
}

/// A value as one table cell or field: strings as they are, `null` or absent
/// as `-`, anything else as compact JSON.
pub(super) fn text(value: &Value) -> String {
    match value {
        Value::Null => "-".to_owned(),
        Value::String(s) if s.is_empty() => "-".to_owned(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Like [`text`], on one line (for tables).
pub(super) fn cell(value: &Value) -> String {
    text(value)
        .lines()
        .map(str::trim)
        .collect::<Vec<_>>()
        .join(" ")
}

/// Columns aligned with two spaces between them; the last is not padded.
pub(super) fn table(indent: &str, headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (width, value) in widths.iter_mut().zip(row) {
            *width = (*width).max(value.chars().count());
        }
    }
    let mut out = String::new();
    let headers: Vec<String> = headers.iter().map(|h| (*h).to_owned()).collect();
    for row in std::iter::once(&headers).chain(rows) {
        let mut line = indent.to_owned();
        for (i, (value, width)) in row.iter().zip(&widths).enumerate() {
            if i + 1 == row.len() {
                line.push_str(value);
            } else {
                let _ = write!(line, "{value:<width$}  ");
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// One `label  value` line; the lines of a multi-line value are aligned.
pub(super) fn field(out: &mut String, label: &str, value: &str) {
    const WIDTH: usize = 13;
    let mut lines = value.lines();
    let _ = writeln!(out, "{label:<WIDTH$}{}", lines.next().unwrap_or("-"));
    for line in lines {
        let _ = writeln!(out, "{:WIDTH$}{line}", "");
    }
}

pub(super) fn render_job(job: &Value) -> String {
    let mut out = String::new();
    field(&mut out, "id", &text(&job["id"]));
    field(&mut out, "queue", &text(&job["queue"]));
    field(&mut out, "state", &text(&job["state"]));
    field(
        &mut out,
        "attempt",
        &format!(
            "{} of {}",
            text(&job["attempt"]),
            text(&job["max_attempts"])
        ),
    );
    field(&mut out, "priority", &text(&job["priority"]));
    field(&mut out, "dedup key", &text(&job["dedup_key"]));
    field(&mut out, "run at", &text(&job["run_at"]));
    field(&mut out, "enqueued at", &text(&job["enqueued_at"]));
    field(&mut out, "finished at", &text(&job["finished_at"]));
    field(&mut out, "payload", &text(&job["payload"]));
    field(&mut out, "result", &text(&job["result"]));
    field(&mut out, "last error", &text(&job["last_error"]));

    let attempts = job["attempts"].as_array().map(Vec::as_slice).unwrap_or(&[]);
    out.push('\n');
    if attempts.is_empty() {
        out.push_str("attempts: none\n");
    } else {
        out.push_str("attempts:\n");
        let rows: Vec<Vec<String>> = attempts
            .iter()
            .map(|a| {
                vec![
                    cell(&a["number"]),
                    cell(&a["started_at"]),
                    cell(&a["ended_at"]),
                    cell(&a["outcome"]),
                    cell(&a["fencing_token"]),
                    cell(&a["plugin_version"]).chars().take(12).collect(),
                    cell(&a["error"]),
                ]
            })
            .collect();
        out.push_str(&table(
            "  ",
            &[
                "#", "STARTED", "ENDED", "OUTCOME", "TOKEN", "VERSION", "ERROR",
            ],
            &rows,
        ));
    }

    let effects = job["effects"].as_array().map(Vec::as_slice).unwrap_or(&[]);
    if effects.is_empty() {
        out.push_str("effects: none\n");
    } else {
        out.push_str("effects:\n");
        let rows: Vec<Vec<String>> = effects
            .iter()
            .map(|e| {
                vec![
                    cell(&e["attempt"]),
                    cell(&e["kind"]),
                    cell(&e["key"]),
                    cell(&e["outcome"]),
                    cell(&e["at"]),
                ]
            })
            .collect();
        out.push_str(&table(
            "  ",
            &["ATTEMPT", "KIND", "KEY", "OUTCOME", "AT"],
            &rows,
        ));
    }
    out
}

pub(super) fn render_jobs(page: &Value) -> String {
    let jobs = page["jobs"].as_array().map(Vec::as_slice).unwrap_or(&[]);
    let mut out = if jobs.is_empty() {
        "no jobs\n".to_owned()
    } else {
        let rows: Vec<Vec<String>> = jobs
            .iter()
            .map(|job| {
                vec![
                    cell(&job["id"]),
                    cell(&job["queue"]),
                    cell(&job["state"]),
                    format!("{}/{}", cell(&job["attempt"]), cell(&job["max_attempts"])),
                    cell(&job["enqueued_at"]),
                ]
            })
            .collect();
        table(
            "",
            &["ID", "QUEUE", "STATE", "ATTEMPT", "ENQUEUED AT"],
            &rows,
        )
    };
    if let Some(cursor) = page["next_cursor"].as_str().filter(|c| !c.is_empty()) {
        let _ = writeln!(out, "more: --cursor {cursor}");
    }
    out
}

pub(super) fn render_job_state(job: &Value, id: &str) -> String {
    let id = job["id"].as_str().unwrap_or(id);
    format!("{id}: {}\n", text(&job["state"]))
}

pub(super) fn render_schedules(answer: &Value) -> String {
    let schedules = answer["schedules"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or(&[]);
    if schedules.is_empty() {
        return "no schedules\n".to_owned();
    }
    let any_error = schedules.iter().any(|s| !s["last_error"].is_null());
    let mut headers = vec![
        "NAME",
        "QUEUE",
        "CRON",
        "TIMEZONE",
        "NEXT FIRE",
        "LAST FIRE",
    ];
    if any_error {
        headers.push("LAST ERROR");
    }
    let rows: Vec<Vec<String>> = schedules
        .iter()
        .map(|s| {
            let mut row = vec![
                cell(&s["name"]),
                cell(&s["queue"]),
                cell(&s["cron"]),
                cell(&s["timezone"]),
                cell(&s["next_fire"]),
                cell(&s["last_fire"]),
            ];
            if any_error {
                row.push(cell(&s["last_error"]));
            }
            row
        })
        .collect();
    table("", &headers, &rows)
}

pub(super) fn render_queues(answer: &Value) -> String {
    let queues = answer["queues"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or(&[]);
    if queues.is_empty() {
        return "no queues\n".to_owned();
    }
    let any_error = queues.iter().any(|q| !q["load_error"].is_null());
    let mut headers = vec![
        "NAME",
        "PLUGIN",
        "VERSION",
        "WAITING",
        "DELAYED",
        "ACTIVE",
        "COMPLETED",
        "DEAD",
        "CANCELLED",
    ];
    if any_error {
        headers.push("LOAD ERROR");
    }
    let rows: Vec<Vec<String>> = queues
        .iter()
        .map(|q| {
            let counts = &q["counts"];
            let mut row = vec![
                cell(&q["name"]),
                cell(&q["plugin"]),
                cell(&q["version"]).chars().take(12).collect(),
                cell(&counts["waiting"]),
                cell(&counts["delayed"]),
                cell(&counts["active"]),
                cell(&counts["completed"]),
                cell(&counts["dead"]),
                cell(&counts["cancelled"]),
            ];
            if any_error {
                row.push(cell(&q["load_error"]));
            }
            row
        })
        .collect();
    table("", &headers, &rows)
}

pub(super) fn render_fences(answer: &Value) -> String {
    let fences = answer["fences"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or(&[]);
    if fences.is_empty() {
        return "no fences\n".to_owned();
    }
    let rows: Vec<Vec<String>> = fences
        .iter()
        .map(|f| {
            vec![
                cell(&f["namespace"]),
                cell(&f["kind"]),
                cell(&f["key"]),
                cell(&f["state"]),
                cell(&f["job_id"]),
                cell(&f["attempt"]),
                cell(&f["updated_at"]),
            ]
        })
        .collect();
    table(
        "",
        &[
            "NAMESPACE",
            "KIND",
            "KEY",
            "STATE",
            "JOB",
            "ATTEMPT",
            "UPDATED AT",
        ],
        &rows,
    )
}
