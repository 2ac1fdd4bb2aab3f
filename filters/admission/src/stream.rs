//! One HTTP request through the admission filter: the admission stage, mapped to actions.

use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, MapType};

use kvoy_filter_common::HeaderCache;
use kvoy_filter_stages::admission::{AdmissionStage, Verdict};

use crate::SharedState;

pub(crate) struct AdmissionStream {
    state: SharedState,
    stage: AdmissionStage,
}

impl AdmissionStream {
    pub fn new(state: SharedState, id: u32) -> Self {
        AdmissionStream {
            state,
            stage: AdmissionStage::new(id),
        }
    }

    /// `Pause` while this request waits in the queue (Envoy would continue it when its body
    /// or trailers arrive), `Continue` otherwise.
    fn hold(&mut self) -> Action {
        let guard = self.state.borrow();
        if self.stage.is_held(guard.as_ref()) {
            Action::Pause
        } else {
            Action::Continue
        }
    }

    fn finish(&mut self) {
        let state = self.state.clone();
        let mut guard = state.borrow_mut();
        if let Some(vm) = guard.as_mut() {
            self.stage
                .finish(vm, &mut kvoy_filter_stages::admission::resume_at_once);
        }
    }
}

impl Context for AdmissionStream {
    fn on_done(&mut self) -> bool {
        self.finish();
        true
    }
}

impl HttpContext for AdmissionStream {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        let state = self.state.clone();
        let mut guard = state.borrow_mut();
        let Some(vm) = guard.as_mut() else {
            return Action::Continue;
        };
        match self
            .stage
            .on_request_headers(vm, &HeaderCache::new(MapType::HttpRequestHeaders))
        {
            Verdict::Admit => Action::Continue,
            Verdict::Hold | Verdict::Replied => Action::Pause,
        }
    }

    fn on_http_request_body(&mut self, _body_size: usize, _end_of_stream: bool) -> Action {
        self.hold()
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        // A request ending with trailers (HTTP/2, chunked HTTP/1.1) stays held too: the SDK's
        // default would let it go on while it still waits in the queue, uncounted.
        self.hold()
    }

    fn on_log(&mut self) {
        self.finish();
    }
}
