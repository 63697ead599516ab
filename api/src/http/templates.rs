//! `GET /v1/templates`: the templates a create may name.

use axum::extract::State;
use axum::Json;

use crate::auth::Caller;
use crate::error::ApiError;
use crate::model::Template;
use crate::service;
use crate::AppState;

/// `GET /v1/templates`
#[utoipa::path(get, path = "/v1/templates", tag = "sandboxes", responses((status = 200, body = [Template])),
    security(("bearer" = [])))]
pub async fn templates(
    State(app): State<AppState>,
    _caller: Caller,
) -> Result<Json<Vec<Template>>, ApiError> {
    Ok(Json(service::templates::list(&app.db).await?))
}
