//! The tests' HTTP/1.1 client: the test kit's ([`kvoy_testkit::http`], on hyper), under the
//! names the tests here have always called.

pub use kvoy_testkit::http::{
    post_json, request, send, stream, Connection, Head, Headers, HttpError, Part, Request,
    Response, MAX_CLIENT_BODY,
};
