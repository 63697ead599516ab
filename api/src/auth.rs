//! The [`Caller`] and [`Admin`] extractors: resolve a request's bearer key to its org (or to
//! an operator). Keys themselves (creation, hashing, lookup) are [`crate::service::keys`],
//! re-exported here.
//!
//! A key is looked up in the process's cache first ([`crate::limits::Guards::cached_key`],
//! a few seconds' TTL); a miss costs one token of the client address's lookup budget before
//! Postgres is asked, so a flood of bad keys is refused (429) without queries. Every
//! authenticated request then counts against its key's rate.

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use berth_schemas::{ApiKeyId, OrgId};

pub use crate::service::keys::{
    authenticate, create_admin_key, create_key, create_org, create_org_with_quota, generate_key,
    CreateOrgError, Principal, KEY_PREFIX,
};

use crate::error::ApiError;
use crate::AppState;

/// The authenticated caller of a request.
#[derive(Debug, Clone, Copy)]
pub struct Caller {
    /// The org the key belongs to; every sandbox route is scoped to it.
    pub org_id: OrgId,
    /// The key that authenticated the request; `None` when a sandbox's execd token did (the
    /// OpenSandbox execd surface, [`crate::compat`]), which reaches that sandbox only.
    pub key_id: Option<ApiKeyId>,
}

async fn principal(parts: &Parts, state: &AppState) -> Result<Principal, ApiError> {
    principal_of(
        &parts.headers,
        crate::limits::peer_ip(&parts.extensions),
        &state.db,
        &state.guards,
    )
    .await
}

/// The berth API key of the request's `Authorization: Bearer` value that carries one, among
/// all its `Authorization` headers. The scheme is case-insensitive (RFC 9110 §11.1) and parted
/// from the key by any run of spaces or tabs (RFC 9110's `1*SP` read leniently, as clients send
/// it): `Basic …` followed by `Bearer berth_…`, or `Bearer<TAB>berth_…`, still name the key.
///
/// Errors: [`ApiError::InvalidRequest`] (field `Authorization`) when the headers name two
/// different Berth keys: which one a request acts as must not depend on header order (a proxy
/// that adds its own key after the client's would otherwise act as the client's).
pub fn bearer_key(headers: &axum::http::HeaderMap) -> Result<Option<&str>, ApiError> {
    let mut keys = headers
        .get_all(axum::http::header::AUTHORIZATION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .filter_map(|v| {
            let v = v.trim_matches([' ', '\t']);
            let (scheme, key) = v.split_once([' ', '\t'])?;
            scheme
                .eq_ignore_ascii_case("bearer")
                .then(|| key.trim_matches([' ', '\t']))
        })
        .filter(|k| k.starts_with(KEY_PREFIX));
    let first = keys.next();
    if keys.any(|other| Some(other) != first) {
        return Err(ApiError::invalid(
            "Authorization",
            "more than one API key: send one `Authorization: Bearer` key",
        ));
    }
    Ok(first)
}

/// Resolves the request's bearer key (cache first, then Postgres within the client address
/// `peer`'s lookup budget) and counts the request against the key's rate.
///
/// Errors: [`ApiError::Unauthorized`] without a known key; [`ApiError`]'s rate refusals.
pub(crate) async fn principal_of(
    headers: &axum::http::HeaderMap,
    peer: Option<std::net::IpAddr>,
    db: &sqlx::PgPool,
    guards: &crate::limits::Guards,
) -> Result<Principal, ApiError> {
    principal_of_key(bearer_key(headers)?, peer, db, guards).await
}

/// Like [`principal_of`], for a key the caller took from elsewhere than `Authorization` (the
/// OpenSandbox surface's `OPEN-SANDBOX-API-KEY`); `None` or a key without Berth's prefix is
/// unauthorized.
///
/// Errors: as [`principal_of`].
pub(crate) async fn principal_of_key(
    key: Option<&str>,
    peer: Option<std::net::IpAddr>,
    db: &sqlx::PgPool,
    guards: &crate::limits::Guards,
) -> Result<Principal, ApiError> {
    let key = key
        .map(str::trim)
        .filter(|k| k.starts_with(KEY_PREFIX))
        .ok_or(ApiError::Unauthorized)?;
    let hash = crate::service::keys::hash(key);
    let principal = match guards.cached_key(&hash) {
        Some(principal) => principal,
        None => {
            guards.check_lookup(peer)?;
            let principal = crate::service::keys::authenticate_hash(db, &hash)
                .await?
                .ok_or(ApiError::Unauthorized)?;
            guards.cache_key(hash, principal);
            principal
        }
    };
    guards.check_key(principal.key_id)?;
    Ok(principal)
}

impl FromRequestParts<AppState> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let p = principal(parts, state).await?;
        let org_id = p.org_id.ok_or_else(|| {
            ApiError::Forbidden("an operator key manages hosts, not sandboxes".into())
        })?;
        Ok(Caller {
            org_id,
            key_id: Some(p.key_id),
        })
    }
}

/// Any authenticated key, an org's or an operator's: the caller of the routes both read (the
/// templates every org shares: an operator registers them and waits on their pulls, an org
/// creates from them).
#[derive(Debug, Clone, Copy)]
pub struct Authenticated {
    /// The key that authenticated the request.
    pub key_id: ApiKeyId,
}

impl FromRequestParts<AppState> for Authenticated {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let p = principal(parts, state).await?;
        Ok(Authenticated { key_id: p.key_id })
    }
}

/// An operator: the caller of the `/v1/hosts` routes (an admin key).
#[derive(Debug, Clone, Copy)]
pub struct Admin {
    /// The admin key that authenticated the request.
    pub key_id: ApiKeyId,
}

impl FromRequestParts<AppState> for Admin {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let p = principal(parts, state).await?;
        if !p.is_admin {
            return Err(ApiError::Forbidden(
                "this route needs an operator key".into(),
            ));
        }
        Ok(Admin { key_id: p.key_id })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::{header::AUTHORIZATION, HeaderMap, HeaderValue};

    fn headers(values: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append(AUTHORIZATION, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn a_bearer_key_is_found_in_any_authorization_header_and_any_spacing() {
        let key = |values: &[&str]| bearer_key(&headers(values)).unwrap().map(str::to_owned);
        let found = Some("berth_abc".to_owned());
        assert_eq!(key(&["Bearer berth_abc"]), found);
        assert_eq!(key(&["bearer\tberth_abc"]), found);
        assert_eq!(key(&["BEARER  \t berth_abc "]), found);
        assert_eq!(key(&["Basic dXNlcjpwdw==", "Bearer berth_abc"]), found);
        assert_eq!(
            key(&["Bearer someone-elses-token", "Bearer berth_abc"]),
            found
        );
        assert_eq!(key(&["Bearer berth_abc", "Bearer berth_abc"]), found);
        assert_eq!(key(&["Bearer someone-elses-token"]), None);
        assert_eq!(key(&["Basic berth_abc"]), None);
        assert_eq!(key(&["Bearerberth_abc"]), None);
        assert_eq!(key(&[]), None);
    }

    /// Found by an attack run: with two keys the first one that was a Berth key won, so a
    /// proxy's key appended after the client's acted as the client's.
    #[test]
    fn two_different_keys_are_refused_naming_the_header() {
        for values in [
            ["Bearer berth_abc", "Bearer berth_def"],
            ["Bearer berth_def", "bearer berth_abc"],
        ] {
            match bearer_key(&headers(&values)) {
                Err(ApiError::InvalidRequest { field, .. }) => {
                    assert_eq!(field.as_deref(), Some("Authorization"))
                }
                other => panic!("{values:?}: {other:?}"),
            }
        }
    }
}
