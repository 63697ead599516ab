//! Parsing shared by the routes: JSON bodies whose errors name the field, and ids in paths.

use axum::extract::rejection::JsonRejection;

use crate::error::ApiError;

/// Maps axum's JSON rejection to a 400 that names the field serde complained about.
pub(crate) fn json_error(rejection: JsonRejection) -> ApiError {
    let text = rejection.body_text();
    // axum reports "...: <path>: <serde message>" for data errors; the path is the field.
    let field = text
        .split_once("target type: ")
        .and_then(|(_, rest)| rest.split_once(": "))
        .map(|(path, _)| path.to_owned())
        .filter(|p| !p.contains(' '));
    ApiError::InvalidRequest {
        field,
        message: text,
    }
}

/// Parses an id from a path; one that does not parse names nothing, so it is "not found".
pub(crate) fn parse_path_id<T: std::str::FromStr>(raw: &str, what: &str) -> Result<T, ApiError> {
    raw.parse()
        .map_err(|_| ApiError::NotFound(format!("{what} {raw}")))
}
