//! `/v1/templates` (list, build from a recipe, delete) and `/v1/events`.

use reqwest::Method;
use space_api::{Operation, Template, TemplateList};

use crate::sse::{EventDecoder, EventStream, EventsQuery, SseParser};
use crate::stream::decoded;
use crate::{Client, Result};

impl Client {
    /// `GET /v1/templates`: the built-ins and the caller's own.
    pub async fn templates(&self) -> Result<Vec<Template>> {
        let list: TemplateList = self
            .get_json(Method::GET, &["v1", "templates"], &[])
            .await?;
        Ok(list.templates)
    }

    /// `POST /v1/templates`: the `build` operation of a recipe (the recipe's JSON
    /// form, files inlined; the server's type is `space_runtime::build::Recipe`,
    /// which a client does not link).
    pub async fn build_template<R: serde::Serialize + ?Sized>(
        &self,
        recipe: &R,
    ) -> Result<Operation> {
        let url = self.url(&["v1", "templates"], &[])?;
        // Untimed: a recipe with its files inlined may be large.
        self.send_json(self.req(Method::POST, url, false).json(recipe))
            .await
    }

    /// `DELETE /v1/templates/{name}` (every version; 409 while a sandbox uses it).
    pub async fn delete_template(&self, name: &str) -> Result<()> {
        let url = self.url(&["v1", "templates", name], &[])?;
        self.send_ok(self.req(Method::DELETE, url, true)).await?;
        Ok(())
    }

    /// `GET /v1/events[?after=N]` (or `Last-Event-ID: N`): every sandbox and
    /// operation change of the caller's, as they happen.
    pub async fn events(&self, q: &EventsQuery) -> Result<EventStream> {
        let query: Vec<(&str, String)> = q
            .after
            .map(|a| ("after", a.to_string()))
            .into_iter()
            .collect();
        let url = self.url(&["v1", "events"], &query)?;
        let mut rb = self.req(Method::GET, url, false);
        if let Some(id) = q.last_event_id {
            rb = rb.header("last-event-id", id.to_string());
        }
        let resp = self.send_ok(rb).await?;
        Ok(decoded(
            self.byte_stream(resp),
            EventDecoder(SseParser::new()),
        ))
    }
}
