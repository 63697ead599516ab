//! Parsing shared by the routes: ids in paths and strict queries (JSON bodies are
//! [`super::body`]).

use crate::error::ApiError;

/// Parses an id from a path; one that does not parse names nothing, so it is "not found".
pub(crate) fn parse_path_id<T: std::str::FromStr>(raw: &str, what: &str) -> Result<T, ApiError> {
    raw.parse()
        .map_err(|_| ApiError::NotFound(format!("{what} {raw}")))
}

/// The 400 for a query string that did not parse: the parameter named in `field` when serde
/// says which, the message in words (not axum's "Failed to deserialize query string: …").
pub(crate) fn query_error(rejection: axum::extract::rejection::QueryRejection) -> ApiError {
    let text = rejection.body_text();
    let detail = text
        .strip_prefix("Failed to deserialize query string: ")
        .unwrap_or(&text);
    let (path, raw) = match detail.split_once(": ") {
        Some((path, raw)) if !path.is_empty() && !path.contains(' ') && path != "." => {
            (Some(path.to_owned()), raw)
        }
        _ => (None, detail),
    };
    let (field, message) = super::body::data_error("the query", path, raw);
    ApiError::InvalidRequest { field, message }
}

/// The query parameters a query struct accepts, by name.
pub trait KnownParams {
    /// Every parameter name the struct reads.
    const NAMES: &'static [&'static str];
}

/// No query parameters at all: the query of a route that reads none.
#[derive(Debug, Default, serde::Deserialize)]
pub struct NoParams {}

impl KnownParams for NoParams {
    const NAMES: &'static [&'static str] = &[];
}

/// A query whose every parameter is one `T` reads ([`KnownParams`]): a misspelt filter
/// (`?sandboxid=`, `?types=`) is refused instead of silently widening what the route returns.
///
/// Errors (the rejection): 400 `invalid_request` whose `field` names the first unknown
/// parameter; 400 for a value `T` cannot take.
#[derive(Debug)]
pub struct StrictQuery<T>(pub T);

impl<S, T> axum::extract::FromRequestParts<S> for StrictQuery<T>
where
    S: Send + Sync,
    T: serde::de::DeserializeOwned + KnownParams,
{
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        _state: &S,
    ) -> Result<Self, ApiError> {
        check_params(&parts.uri, T::NAMES)?;
        let axum::extract::Query(query) =
            axum::extract::Query::<T>::try_from_uri(&parts.uri).map_err(query_error)?;
        Ok(StrictQuery(query))
    }
}

/// Refuses a query parameter of `uri` that is not among `known`.
///
/// Errors: 400 `invalid_request` naming the parameter (`field`) and what the route takes.
pub fn check_params(uri: &axum::http::Uri, known: &[&str]) -> Result<(), ApiError> {
    let axum::extract::Query(pairs) =
        axum::extract::Query::<Vec<(String, String)>>::try_from_uri(uri).map_err(query_error)?;
    match pairs
        .iter()
        .find(|(name, _)| !known.contains(&name.as_str()))
    {
        None => Ok(()),
        Some((name, _)) if known.is_empty() => Err(ApiError::invalid(
            name,
            format!("unknown query parameter {name:?}: this route takes none"),
        )),
        Some((name, _)) => Err(ApiError::invalid(
            name,
            format!(
                "unknown query parameter {name:?}: this route takes {}",
                known.join(", ")
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn uri(s: &str) -> axum::http::Uri {
        s.parse().unwrap()
    }

    #[test]
    fn an_unknown_parameter_is_named_and_known_ones_pass() {
        assert!(check_params(&uri("/v1/events"), &["type"]).is_ok());
        assert!(check_params(&uri("/v1/events?type=a&type=b"), &["type"]).is_ok());
        let refused = check_params(&uri("/v1/events?type=a&sandboxid=x"), &["type"]);
        assert!(
            matches!(&refused, Err(ApiError::InvalidRequest { field: Some(f), .. }) if f == "sandboxid"),
            "{refused:?}"
        );
        let none = check_params(&uri("/v1/templates?x=1"), &[]);
        assert!(
            matches!(&none, Err(ApiError::InvalidRequest { field: Some(f), .. }) if f == "x"),
            "{none:?}"
        );
    }
}
