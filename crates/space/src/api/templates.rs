//! `/v1/templates`.

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use space_api::{Template, TemplateList};

use super::{AppState, HttpError};
use crate::service::ServiceError;

pub async fn list(State(st): State<AppState>) -> Response {
    match st.service.templates().list() {
        Ok(list) => {
            let templates = list
                .into_iter()
                .map(|t| Template {
                    name: t.name,
                    ready: t.ready,
                    builtin: t.builtin,
                    version: t.template.as_ref().map(|x| x.version.clone()),
                    size_bytes: t.template.as_ref().map(|x| x.size_bytes),
                    created_at: t.template.as_ref().map(|x| x.created_at.clone()),
                })
                .collect();
            Json(TemplateList { templates }).into_response()
        }
        Err(e) => HttpError(ServiceError::Internal(e.to_string())).into_response(),
    }
}
