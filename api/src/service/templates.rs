//! The `templates` table: a template imported on the hosts (`berth template import`) is
//! registered here so creates may name it; [`list`] serves `GET /v1/templates`.

use berth_store::templates::{self, TemplateRow};
use berth_store::StoreError;
use sqlx::PgPool;

use super::ServiceError;
use crate::model::Template;

/// Registers (or updates) template `name` with `runtime` (`runc`, `runsc`).
///
/// The template's root filesystem must exist on every host that may be chosen for it (hostd
/// finds imported templates in its machine's template cache); placement does not check.
///
/// Errors: [`StoreError`] (a runtime other than `runc` or `runsc` breaks the table's CHECK).
pub async fn register(
    db: &PgPool,
    name: &str,
    description: &str,
    runtime: &str,
) -> Result<(), StoreError> {
    templates::upsert(
        db,
        &TemplateRow {
            name: name.to_owned(),
            description: description.to_owned(),
            runtime: runtime.to_owned(),
        },
    )
    .await
}

/// Every registered template, by name.
pub async fn list(db: &PgPool) -> Result<Vec<Template>, ServiceError> {
    Ok(templates::list(db)
        .await?
        .into_iter()
        .map(|t| Template {
            name: t.name,
            description: t.description,
            runtime: t.runtime,
        })
        .collect())
}
