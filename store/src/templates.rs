//! The `templates` table: the registry of template names and the runtime each runs on. Written
//! by migrations (the built-in templates) and by `berth template import`; read by creates.

use berth_schemas::wire::Runtime;
use sqlx::PgExecutor;

use crate::op::{timed, Op};
use crate::StoreError;

/// A registered template.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct TemplateRow {
    /// The name creates use (`base`, …).
    pub name: String,
    /// A one-line description for listings.
    pub description: String,
    /// `runc` or `runsc`.
    pub runtime: String,
}

impl TemplateRow {
    /// The runtime as the wire names it.
    ///
    /// Errors: [`StoreError::Corrupt`] for a spelling this build does not know (the table's
    /// CHECK allows only `runc` and `runsc`).
    pub fn runtime(&self) -> Result<Runtime, StoreError> {
        crate::sandboxes::runtime(&self.runtime)
    }
}

/// The template named `name`, or `None`.
pub async fn get(db: impl PgExecutor<'_>, name: &str) -> Result<Option<TemplateRow>, StoreError> {
    timed(
        Op::TemplateGet,
        sqlx::query_as("SELECT name, description, runtime FROM templates WHERE name = $1")
            .bind(name)
            .fetch_optional(db),
    )
    .await
}

/// Every template, by name.
pub async fn list(db: impl PgExecutor<'_>) -> Result<Vec<TemplateRow>, StoreError> {
    timed(
        Op::TemplateList,
        sqlx::query_as("SELECT name, description, runtime FROM templates ORDER BY name")
            .fetch_all(db),
    )
    .await
}

/// Registers `template`, or updates its description and runtime.
pub async fn upsert(db: impl PgExecutor<'_>, template: &TemplateRow) -> Result<(), StoreError> {
    timed(
        Op::TemplateUpsert,
        sqlx::query(
            "INSERT INTO templates (name, description, runtime) VALUES ($1, $2, $3)
             ON CONFLICT (name) DO UPDATE
                SET description = EXCLUDED.description, runtime = EXCLUDED.runtime",
        )
        .bind(&template.name)
        .bind(&template.description)
        .bind(&template.runtime)
        .execute(db),
    )
    .await?;
    Ok(())
}
