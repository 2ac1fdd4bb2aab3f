//! The bindings the page's script calls (`wasm-bindgen --target web`): [`Explainer`] as a JS
//! class, bytes in as `Uint8Array`, the answer out as JSON text. Errors become JS `Error`s
//! with the typed error's message.

use wasm_bindgen::prelude::*;

/// `new Explainer(configJson)`; then `setSnapshot(bytes)`, `addDecisions(bytes)` per page,
/// `explain(path, body, sessionToken)`.
#[wasm_bindgen(js_name = Explainer)]
pub struct JsExplainer(crate::Explainer);

#[wasm_bindgen(js_class = Explainer)]
impl JsExplainer {
    #[wasm_bindgen(constructor)]
    pub fn new(config_json: &str) -> Result<JsExplainer, JsError> {
        crate::Explainer::new(config_json)
            .map(JsExplainer)
            .map_err(js)
    }

    #[wasm_bindgen(js_name = setSnapshot)]
    pub fn set_snapshot(&mut self, body: &[u8]) -> Result<(), JsError> {
        self.0.set_snapshot(body).map_err(js)
    }

    /// Keeps one page of relayed decisions; answers `[count, cursor]`, the cursor as a
    /// decimal string (a u64).
    #[wasm_bindgen(js_name = addDecisions)]
    pub fn add_decisions(&mut self, body: &[u8]) -> Result<Vec<String>, JsError> {
        let (count, cursor) = self.0.add_decisions(body).map_err(js)?;
        Ok(vec![count.to_string(), cursor.to_string()])
    }

    /// The answer as JSON text (see [`crate::Explainer::explain`]).
    pub fn explain(
        &self,
        path: &str,
        body: &[u8],
        session_token: Option<String>,
    ) -> Result<String, JsError> {
        self.0
            .explain(path, body, session_token.as_deref())
            .map(|v| v.to_string())
            .map_err(js)
    }
}

fn js(e: crate::ExplainError) -> JsError {
    JsError::new(&e.to_string())
}
