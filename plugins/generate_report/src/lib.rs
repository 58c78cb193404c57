//! `generate_report`: builds a report, stores it, and mails it once per job
//! (a job-scoped idempotency key: the job id is the stable key).
//!
//! Grants: `kv` and `email` (the example `jobs.toml` runs it on queue
//! `generate-report`).
//! Payload: `{"report_id": "r-7", "period": "2025-01", "to": "ops@example.com"}`;
//! `report_id` is a non-negative integer or a non-empty string, `period` a
//! non-empty string (`YYYY`, `YYYY-MM` and `YYYY-MM-DD` are read as a year, a
//! month and a day; anything else is a custom period, used as it is), and `to`
//! is optional (default `reports@example.com`). Neither `report_id` nor
//! `period` may hold control characters: both go into the subject.
//! Result: `{"report_id": "r-7", "message_id": "<...@example.com>", "replayed": false}`;
//! `replayed` is true when this job had mailed the report already (in an
//! earlier attempt) and nothing was sent now.
//!
//! The report is plain text built from the payload alone (see [`report`]): no
//! clock, no randomness, so every attempt builds the same bytes. That is what
//! makes the steps safe to repeat:
//!
//! 1. `kv::put("report:<report_id>", text)`: writing the same value again is
//!    harmless, so an attempt that dies after this step and before the mail
//!    leaves nothing wrong behind.
//! 2. `email::send(job.key("report"), message)`, key `<job-id>:report`: the
//!    host mails it once for this job and replays the recorded receipt on any
//!    later attempt. A report that changed between attempts (a new version of
//!    this plugin, loaded in between, that words it differently) would be
//!    refused as `key-reused`, and the job fails for a person to look at.
//!
//! The key is scoped to the job, not to `report_id`: one job mails its report
//! once, however often it is delivered, but a *second job* for the same report
//! (another job id) mails it again. To mail each report once, give its jobs a
//! stable id, such as `khata enqueue generate-report '{...}' --id report-<report_id>`
//! (enqueueing that id again returns the existing job), or let a schedule
//! enqueue them (each firing has its own fixed id, docs/jobs-toml.md#schedulesname).
//!
//! With the outbox transport a send whose outcome is unknown is settled by
//! looking for the message's file. Over SMTP the queue's `on_uncertain` policy
//! decides; with the default `skip` the job fails with `uncertain` and an
//! operator resolves the fence (`khata fences --state uncertain`).

use khata_sdk::prelude::*;
use serde::Deserialize;
use serde_json::{Value, json};

/// The payload.
#[derive(Deserialize)]
struct Request {
    report_id: Value,
    period: String,
    #[serde(default = "default_to")]
    to: String,
}

/// Where reports go when the payload names no `to`.
const DEFAULT_TO: &str = "reports@example.com";

fn default_to() -> String {
    DEFAULT_TO.to_owned()
}

fn handle(job: Job) -> Result<Value, Error> {
    let request: Request = job.payload()?;
    let report_id = validate(&request)?;
    let period = request.period.trim();
    let text = report(&report_id, period);

    kv::put(format!("report:{report_id}"), &text)?;

    let message =
        email::Message::new(format!("Report {report_id}: {period}"), text).to(request.to.clone());
    let key = job.key("report");
    let receipt = match email::send(&key, &message) {
        Ok(receipt) => receipt,
        Err(EffectError::KeyReused(reason)) => {
            return Err(Error::fail(format!(
                "this job mailed a different report before (key {key}); was the plugin \
                 changed between attempts? {reason}"
            )));
        }
        Err(e) => return Err(e.into()),
    };

    Ok(json!({
        "report_id": request.report_id,
        "message_id": receipt.message_id,
        "replayed": receipt.replayed,
    }))
}

/// Checks the payload; returns the report id as key text.
fn validate(request: &Request) -> Result<String, Error> {
    let report_id = match &request.report_id {
        Value::String(text) if !text.is_empty() => text.clone(),
        Value::Number(n) if n.is_u64() => n.to_string(),
        other => {
            return Err(Error::fail(format!(
                "bad payload: report_id must be a non-empty string or a non-negative integer, \
                 got {other}"
            )));
        }
    };
    if report_id.chars().any(char::is_control) {
        return Err(Error::fail(
            "bad payload: report_id must not hold control characters",
        ));
    }
    let period = request.period.trim();
    if period.is_empty() || period.chars().any(char::is_control) {
        return Err(Error::fail(format!(
            "bad payload: period must be non-empty text without control characters, got {:?}",
            request.period
        )));
    }
    Ok(report_id)
}

/// The report's text: a header and a few lines derived from the period. The
/// same arguments always give the same text (the email fence relies on it).
fn report(report_id: &str, period: &str) -> String {
    let period = period.trim();
    let mut text = format!("Report {report_id}\nPeriod: {period}\n\n");
    match Span::parse(period) {
        Some(span) => {
            let (first, last) = (span.first(), span.last());
            text += &format!("Kind: {}\n", span.kind());
            text += &format!("Covers: {first} to {last}\n");
            text += &format!("Days: {}\n", span.days());
            text += &format!("Starts on: {}\n", first.weekday());
        }
        None => text += "Kind: custom (not a calendar year, month or day)\n",
    }
    text += "\nBuilt from the payload alone: the same every time.\n";
    text
}

/// A calendar period named by a `period` of the form `YYYY`, `YYYY-MM` or
/// `YYYY-MM-DD` (proleptic Gregorian, years 1 to 9999).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Span {
    Year(u32),
    Month(u32, u32),
    Day(Date),
}

/// A calendar date.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Date {
    year: u32,
    month: u32,
    day: u32,
}

impl Span {
    fn parse(period: &str) -> Option<Span> {
        let parts: Vec<&str> = period.split('-').collect();
        let number = |part: &str, digits: usize| {
            (part.len() == digits && part.bytes().all(|b| b.is_ascii_digit()))
                .then(|| part.parse::<u32>().ok())
                .flatten()
        };
        let year = number(parts.first()?, 4).filter(|y| *y >= 1)?;
        let month = |part: &str| number(part, 2).filter(|m| (1..=12).contains(m));
        match parts[1..] {
            [] => Some(Span::Year(year)),
            [m] => Some(Span::Month(year, month(m)?)),
            [m, d] => {
                let month = month(m)?;
                let day = number(d, 2).filter(|d| (1..=days_in_month(year, month)).contains(d))?;
                Some(Span::Day(Date { year, month, day }))
            }
            _ => None,
        }
    }

    fn kind(self) -> &'static str {
        match self {
            Span::Year(_) => "year",
            Span::Month(..) => "month",
            Span::Day(_) => "day",
        }
    }

    fn first(self) -> Date {
        match self {
            Span::Year(year) => Date {
                year,
                month: 1,
                day: 1,
            },
            Span::Month(year, month) => Date {
                year,
                month,
                day: 1,
            },
            Span::Day(date) => date,
        }
    }

    fn last(self) -> Date {
        match self {
            Span::Year(year) => Date {
                year,
                month: 12,
                day: 31,
            },
            Span::Month(year, month) => Date {
                year,
                month,
                day: days_in_month(year, month),
            },
            Span::Day(date) => date,
        }
    }

    fn days(self) -> u32 {
        match self {
            Span::Year(year) if is_leap(year) => 366,
            Span::Year(_) => 365,
            Span::Month(year, month) => days_in_month(year, month),
            Span::Day(_) => 1,
        }
    }
}

impl Date {
    /// The day of the week (Sakamoto's method).
    fn weekday(self) -> &'static str {
        const OFFSETS: [u32; 12] = [0, 3, 2, 5, 0, 3, 5, 1, 4, 6, 2, 4];
        const NAMES: [&str; 7] = [
            "Sunday",
            "Monday",
            "Tuesday",
            "Wednesday",
            "Thursday",
            "Friday",
            "Saturday",
        ];
        let y = if self.month < 3 {
            self.year - 1
        } else {
            self.year
        };
        let n = y + y / 4 - y / 100 + y / 400 + OFFSETS[self.month as usize - 1] + self.day;
        NAMES[(n % 7) as usize]
    }
}

impl std::fmt::Display for Date {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:04}-{:02}-{:02}", self.year, self.month, self.day)
    }
}

fn is_leap(year: u32) -> bool {
    (year.is_multiple_of(4) && !year.is_multiple_of(100)) || year.is_multiple_of(400)
}

fn days_in_month(year: u32, month: u32) -> u32 {
    match month {
        2 if is_leap(year) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

khata_sdk::handler!(handle);

#[cfg(test)]
mod tests {
    use super::*;

    fn request(payload: Value) -> Request {
        serde_json::from_value(payload).unwrap()
    }

    #[test]
    fn a_month_report_names_its_days() {
        let text = report("r-7", "2024-02");
        assert_eq!(
            text,
            "Report r-7\nPeriod: 2024-02\n\nKind: month\nCovers: 2024-02-01 to 2024-02-29\n\
             Days: 29\nStarts on: Thursday\n\nBuilt from the payload alone: the same every time.\n"
        );
        assert_eq!(report("r-7", "2024-02"), text, "deterministic");
    }

    #[test]
    fn years_days_and_custom_periods() {
        assert!(report("1", "2023").contains("Covers: 2023-01-01 to 2023-12-31\nDays: 365\n"));
        assert!(report("1", "2000").contains("Days: 366\nStarts on: Saturday\n"));
        assert!(report("1", "2025-01-15").contains("Kind: day\n"));
        assert!(report("1", "2025-01-15").contains("Starts on: Wednesday\n"));
        for custom in [
            "daily",
            "2025-13",
            "2025-02-29",
            "2025-1",
            "0000",
            "2025-01-01-01",
        ] {
            assert!(
                report("1", custom).contains("Kind: custom"),
                "{custom}: {}",
                report("1", custom)
            );
        }
    }

    #[test]
    fn payloads_are_checked_and_to_has_a_default() {
        let ok = request(json!({ "report_id": 7, "period": "2025-01" }));
        assert_eq!(validate(&ok).unwrap(), "7");
        assert_eq!(ok.to, DEFAULT_TO);
        let to = request(json!({ "report_id": "r", "period": "q1", "to": "a@example.com" }));
        assert_eq!(
            (validate(&to).unwrap(), to.to.as_str()),
            ("r".into(), "a@example.com")
        );
        let bad = [
            json!({ "report_id": -1, "period": "2025" }),
            json!({ "report_id": "", "period": "2025" }),
            json!({ "report_id": "a\nb", "period": "2025" }),
            json!({ "report_id": 7, "period": " " }),
            json!({ "report_id": 7, "period": "2025\r\nBcc: x@example.com" }),
        ];
        for payload in bad {
            let err = validate(&request(payload.clone())).unwrap_err();
            assert!(!err.is_retry(), "{payload}");
            assert!(err.message().starts_with("bad payload: "), "{err}");
        }
    }
}
