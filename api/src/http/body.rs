//! JSON request bodies: every `/v1` route that takes one parses it here, so each refuses the
//! same way (an attack run found `POST /v1/keys` reading no body at all, array bodies taken
//! field by field, and serde's raw text, with line and column, in 400 answers).
//!
//! # Guarantees
//! - A body is one JSON object and nothing after it; anything else is 400 `invalid_request`
//!   (an array that serde would read field by position included).
//! - A data error names its `field` when serde says which (`snapshot_id`, `network.egress`,
//!   the unknown field itself), and its message is the field and what was wrong in words: no
//!   Rust type names (`struct ForkRequest`, `u32`), no line and column of a data error. A
//!   syntax error says where the JSON broke (line, column).
//! - A body over [`MAX_BODY_BYTES`] never reaches a parser: the router's `DefaultBodyLimit`
//!   refuses it with 413 `payload_too_large` and `limit` ([`crate::error::json_errors`]).

use serde::de::DeserializeOwned;
use serde_json::error::Category;

use crate::error::ApiError;

/// Largest request body a `/v1` route reads into memory, in bytes (2 MiB, axum's default made
/// explicit). The file upload streams and has its own limit (`--max-file-bytes`).
pub const MAX_BODY_BYTES: usize = 2 * 1024 * 1024;

/// A body with no fields: what `POST /v1/keys` and `POST /v1/sandboxes/{id}/snapshot` take
/// (`{}` or nothing).
#[derive(Debug, Default, serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NoFields {}

/// Parses `body` as one JSON object into `T`.
///
/// Errors: 400 `invalid_request`: an empty body, a body that is not a JSON object, JSON that
/// does not parse or has more after it, a value `T` refuses (with `field`).
pub fn json<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    match body.iter().find(|b| !b.is_ascii_whitespace()) {
        Some(b'{') => {}
        None => {
            return Err(whole_body(
                "the body is empty: this route takes a JSON object",
            ))
        }
        Some(_) => {
            return Err(whole_body(
                "the body must be a JSON object ({…}); an array, a string, a number or other text is refused",
            ))
        }
    }
    let mut de = serde_json::Deserializer::from_slice(body);
    let value = serde_path_to_error::deserialize(&mut de).map_err(error)?;
    de.end().map_err(|e| {
        whole_body(format!(
            "the body has more after its JSON object (line {}, column {})",
            e.line(),
            e.column()
        ))
    })?;
    Ok(value)
}

/// [`json`], with an empty (or whitespace-only) body read as `{}`: for routes whose every
/// field is optional.
///
/// Errors: as [`json`].
pub fn json_or_empty<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        json(b"{}")
    } else {
        json(body)
    }
}

fn whole_body(message: impl Into<String>) -> ApiError {
    ApiError::InvalidRequest {
        field: None,
        message: message.into(),
    }
}

/// The 400 for a body that failed to parse into its type.
fn error(e: serde_path_to_error::Error<serde_json::Error>) -> ApiError {
    let path = match e.path().to_string() {
        p if p == "." || p.is_empty() => None,
        p => Some(p),
    };
    let inner = e.into_inner();
    match inner.classify() {
        Category::Eof => whole_body("the body ends before its JSON object does"),
        Category::Syntax | Category::Io => whole_body(format!(
            "the body is not valid JSON (line {}, column {})",
            inner.line(),
            inner.column()
        )),
        Category::Data => {
            let (field, message) = data_error("the body", path, &without_position(&inner));
            ApiError::InvalidRequest { field, message }
        }
    }
}

/// serde_json's message without its " at line L column C".
fn without_position(e: &serde_json::Error) -> String {
    let text = e.to_string();
    let suffix = format!(" at line {} column {}", e.line(), e.column());
    text.strip_suffix(&suffix).unwrap_or(&text).to_owned()
}

/// The field and the message of a data error whose serde message is `raw`, found at `path`
/// (`None`: the top level of `whole`, "the body" or "the query").
pub(crate) fn data_error(whole: &str, path: Option<String>, raw: &str) -> (Option<String>, String) {
    let under = |name: &str| match &path {
        // The path of an unknown field ends with the field itself; a missing one's does not.
        Some(p) if p == name || p.ends_with(&format!(".{name}")) => p.clone(),
        Some(p) => format!("{p}.{name}"),
        None => name.to_owned(),
    };
    if let Some(rest) = raw.strip_prefix("unknown field `") {
        let (name, known) = rest.split_once('`').unwrap_or((rest, ""));
        let field = under(name);
        let known = known.trim_start_matches(", ");
        let takes = if known == "there are no fields" {
            format!("{whole} takes none")
        } else {
            let list = known
                .trim_start_matches("expected one of ")
                .trim_start_matches("expected ")
                .replace('`', "")
                .replace(" or ", ", ");
            format!("the fields are {list}")
        };
        return (
            Some(field.clone()),
            format!("unknown field {field:?}: {takes}"),
        );
    }
    if let Some(name) = raw
        .strip_prefix("missing field `")
        .and_then(|r| r.strip_suffix('`'))
    {
        let field = under(name);
        return (Some(field.clone()), format!("{field} is required"));
    }
    // A field given twice (an attack run saw this 400 without its field).
    if let Some(name) = raw
        .strip_prefix("duplicate field `")
        .and_then(|r| r.strip_suffix('`'))
    {
        let field = under(name);
        return (Some(field.clone()), format!("{field} is given twice"));
    }
    let said = ["invalid type: ", "invalid value: "]
        .into_iter()
        .find_map(|p| raw.strip_prefix(p))
        .and_then(|r| r.rsplit_once(", expected "))
        .map(|(got, expected)| {
            format!(
                "expected {}, got {}",
                expected_words(expected),
                got_words(got)
            )
        })
        .unwrap_or_else(|| raw.replace('`', "\""));
    let message = match &path {
        Some(p) => format!("{p}: {said}"),
        None => format!("{whole}: {said}"),
    };
    (path, message)
}

/// serde's "expected" side in JSON's words (no Rust type names).
fn expected_words(expected: &str) -> String {
    let words = match expected {
        "u8" => "an integer from 0 to 255",
        "u16" => "an integer from 0 to 65535",
        "u32" => "an integer from 0 to 4294967295",
        "u64" | "usize" => "a non-negative integer",
        "i8" | "i16" | "i32" | "i64" | "isize" => "an integer",
        "f32" | "f64" => "a number",
        "a map" => "a JSON object",
        "a sequence" => "a JSON array",
        "unit" => "null",
        e if e.starts_with("struct ") => "a JSON object",
        e if e.starts_with("a sequence") || e.starts_with("tuple") => "a JSON array",
        e => return e.replace('`', "\""),
    };
    words.to_owned()
}

/// serde's "invalid type" side (what the body held) in JSON's words.
fn got_words(got: &str) -> String {
    let quoted = |p: &str| got.strip_prefix(p).map(|v| v.trim_matches('`').to_owned());
    if let Some(v) = ["integer ", "floating point ", "boolean "]
        .into_iter()
        .find_map(quoted)
    {
        return v;
    }
    match got {
        "sequence" => "an array".to_owned(),
        "map" => "an object".to_owned(),
        "unit value" | "null" => "null".to_owned(),
        g if g.starts_with("string ") => format!("the {g}"),
        g => g.replace('`', "\""),
    }
}

#[cfg(test)]
mod tests {
    use serde::Deserialize;

    use super::*;

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Inner {
        egress: String,
    }

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Body {
        count: u32,
        #[serde(default)]
        port: Option<u16>,
        #[serde(default)]
        inner: Option<Inner>,
    }

    fn refused(body: &str) -> (Option<String>, String) {
        match json::<Body>(body.as_bytes()) {
            Err(ApiError::InvalidRequest { field, message }) => (field, message),
            other => panic!("{body}: {other:?}"),
        }
    }

    #[test]
    fn an_object_parses_and_anything_else_is_refused_as_a_whole() {
        assert_eq!(json::<Body>(b" {\"count\": 2} ").unwrap().count, 2);
        assert!(json_or_empty::<NoFields>(b"").is_ok());
        assert!(json_or_empty::<NoFields>(b" {} ").is_ok());
        for body in ["", "[2]", "\"x\"", "2", "garbage", "null"] {
            let (field, message) = refused(body);
            assert_eq!(field, None, "{body}");
            assert!(message.contains("JSON object"), "{body}: {message}");
        }
        let (field, message) = refused("{\"count\": 2} {}");
        assert_eq!(field, None);
        assert!(message.contains("more after"), "{message}");
        let (field, message) = refused("{\"count\": 2");
        assert_eq!(field, None);
        assert!(message.contains("ends before"), "{message}");
        let (field, message) = refused("{count: 2}");
        assert_eq!(field, None);
        assert_eq!(message, "the body is not valid JSON (line 1, column 2)");
    }

    #[test]
    fn a_data_error_names_its_field_in_words_without_serde_internals() {
        let cases = [
            (
                r#"{"count": "x"}"#,
                "count",
                "count: expected an integer from 0 to 4294967295, got the string \"x\"",
            ),
            (
                r#"{"count": -1}"#,
                "count",
                "count: expected an integer from 0 to 4294967295, got -1",
            ),
            (
                r#"{"count": 1, "port": 70000}"#,
                "port",
                "port: expected an integer from 0 to 65535, got 70000",
            ),
            (r#"{}"#, "count", "count is required"),
            (
                r#"{"count": 1, "colour": "blue"}"#,
                "colour",
                "unknown field \"colour\": the fields are count, port, inner",
            ),
            (
                r#"{"count": 1, "inner": {"egress": 1}}"#,
                "inner.egress",
                "inner.egress: expected a string, got 1",
            ),
            (
                r#"{"count": 1, "inner": {"egres": "x"}}"#,
                "inner.egres",
                "unknown field \"inner.egres\": the fields are egress",
            ),
            (
                r#"{"count": 1, "inner": {}}"#,
                "inner.egress",
                "inner.egress is required",
            ),
            (
                r#"{"count": 1, "inner": "x"}"#,
                "inner",
                "inner: expected a JSON object, got the string \"x\"",
            ),
            (
                r#"{"count": 1, "count": 2}"#,
                "count",
                "count is given twice",
            ),
            (
                r#"{"count": 1, "inner": {"egress": "a", "egress": "b"}}"#,
                "inner.egress",
                "inner.egress is given twice",
            ),
        ];
        for (body, want_field, want_message) in cases {
            let (field, message) = refused(body);
            assert_eq!(field.as_deref(), Some(want_field), "{body}: {message}");
            assert_eq!(message, want_message, "{body}");
            assert!(!message.contains("line 1"), "{body}: {message}");
        }
        let none = json::<NoFields>(br#"{"x": 1}"#);
        assert!(
            matches!(&none, Err(ApiError::InvalidRequest { field: Some(f), message })
                if f == "x" && message == "unknown field \"x\": the body takes none"),
            "{none:?}"
        );
    }
}
