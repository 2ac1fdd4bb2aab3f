//! A headless Chromium driven through W3C WebDriver (Debian's `chromium-driver`), for tests
//! that act on a page as a person would: type into a field, press a button, read what the
//! page's script drew. WebDriver is JSON over HTTP, so [`crate::http`] is the whole client.
//!
//! ```no_run
//! use kvoy_testkit::webdriver::Browser;
//! let browser = Browser::start(std::path::Path::new("/tmp/profile"))?;
//! browser.navigate("http://127.0.0.1:8080/")?;
//! let field = browser.find("#explain-body")?;
//! browser.send_keys(&field, "{}")?;
//! # anyhow::Ok(())
//! ```

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::http;

/// The key WebDriver's element id hides under (W3C WebDriver, "web element identifier").
const ELEMENT_KEY: &str = "element-6066-11e4-a52e-4f735466cecf";
/// Bound on one WebDriver command; typing a few kilobytes is the slowest.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug, thiserror::Error)]
pub enum WebDriverError {
    #[error("chromedriver could not start ({0}): `apt-get install -y chromium-driver`")]
    Spawn(std::io::Error),
    #[error("chromedriver was not ready on {0} within 10 s")]
    NotReady(SocketAddr),
    #[error("WebDriver transport: {0}")]
    Http(#[from] http::HttpError),
    #[error("WebDriver answered {status} to {command}: {body}")]
    Command {
        command: String,
        status: u16,
        body: String,
    },
    #[error("WebDriver's answer to {0} has no {1}")]
    Shape(String, &'static str),
    #[error("timed out after {0:?} waiting for {1}")]
    Timeout(Duration, String),
}

/// An element of the current page, as WebDriver names it.
#[derive(Debug, Clone)]
pub struct Element(String);

/// The chromedriver binary: `KVOY_CHROMEDRIVER`, else `chromedriver` on PATH.
pub fn chromedriver() -> Option<PathBuf> {
    installed("KVOY_CHROMEDRIVER", "chromedriver")
}

/// The Chromium binary: `KVOY_CHROMIUM`, else `chromium` on PATH.
pub fn chromium() -> Option<PathBuf> {
    installed("KVOY_CHROMIUM", "chromium")
}

/// The program `env` names, else `name` on PATH, if it answers `--version`.
fn installed(env: &str, name: &str) -> Option<PathBuf> {
    let bin = std::env::var_os(env).map_or_else(|| PathBuf::from(name), PathBuf::from);
    let ok = Command::new(&bin)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    ok.then_some(bin)
}

/// One chromedriver on 127.0.0.1 with one headless Chromium session; both end on drop.
pub struct Browser {
    driver: Child,
    addr: SocketAddr,
    session: String,
}

impl Browser {
    /// Starts chromedriver and a headless Chromium (`KVOY_CHROMIUM`, else Chromium's own
    /// default binary) with its profile in `profile`, 1280x1240.
    pub fn start(profile: &Path) -> Result<Self, WebDriverError> {
        let bin = chromedriver().unwrap_or_else(|| PathBuf::from("chromedriver"));
        let port = crate::free_port().map_err(WebDriverError::Spawn)?;
        let addr: SocketAddr = ([127, 0, 0, 1], port).into();
        let driver = Command::new(bin)
            .arg(format!("--port={port}"))
            .arg("--allowed-ips=127.0.0.1")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(WebDriverError::Spawn)?;
        let mut browser = Self {
            driver,
            addr,
            session: String::new(),
        };
        let start = Instant::now();
        loop {
            let ready = browser
                .call("GET", "/status", None)
                .ok()
                .and_then(|v| v.get("ready").and_then(Value::as_bool))
                .unwrap_or(false);
            if ready {
                break;
            }
            if start.elapsed() > Duration::from_secs(10) {
                return Err(WebDriverError::NotReady(addr));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let mut options = json!({"args": [
            "--headless=new",
            // Root in a container has no user namespace for the sandbox.
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--hide-scrollbars",
            "--window-size=1280,1240",
            format!("--user-data-dir={}", profile.display()),
        ]});
        if let Some(chromium) = std::env::var_os("KVOY_CHROMIUM") {
            options["binary"] = json!(chromium.to_string_lossy());
        }
        let created = browser.call(
            "POST",
            "/session",
            Some(json!({"capabilities": {"alwaysMatch": {"goog:chromeOptions": options}}})),
        )?;
        browser.session = created
            .get("sessionId")
            .and_then(Value::as_str)
            .ok_or_else(|| WebDriverError::Shape("new session".into(), "sessionId"))?
            .to_owned();
        Ok(browser)
    }

    /// One WebDriver command; its `value`.
    fn call(&self, method: &str, path: &str, body: Option<Value>) -> Result<Value, WebDriverError> {
        let bytes = body.map(|b| b.to_string().into_bytes()).unwrap_or_default();
        let headers: &[(&str, &str)] = if method == "POST" {
            &[("content-type", "application/json")]
        } else {
            &[]
        };
        let r = http::send(self.addr, method, path, headers, &bytes, COMMAND_TIMEOUT)?;
        if r.status != 200 {
            return Err(WebDriverError::Command {
                command: format!("{method} {path}"),
                status: r.status,
                body: r.text(),
            });
        }
        let mut answer: Value = r
            .json()
            .map_err(|_| WebDriverError::Shape(format!("{method} {path}"), "JSON body"))?;
        Ok(answer
            .get_mut("value")
            .map(Value::take)
            .unwrap_or(Value::Null))
    }

    fn session_call(
        &self,
        method: &str,
        path: &str,
        body: Option<Value>,
    ) -> Result<Value, WebDriverError> {
        self.call(method, &format!("/session/{}{path}", self.session), body)
    }

    /// Opens `url` and waits for its load event.
    pub fn navigate(&self, url: &str) -> Result<(), WebDriverError> {
        self.session_call("POST", "/url", Some(json!({ "url": url })))
            .map(drop)
    }

    /// The first element matching the CSS `selector`.
    pub fn find(&self, selector: &str) -> Result<Element, WebDriverError> {
        let v = self.session_call(
            "POST",
            "/element",
            Some(json!({"using": "css selector", "value": selector})),
        )?;
        v.get(ELEMENT_KEY)
            .and_then(Value::as_str)
            .map(|id| Element(id.to_owned()))
            .ok_or_else(|| WebDriverError::Shape(format!("find {selector}"), "element"))
    }

    /// Empties a text field.
    pub fn clear(&self, element: &Element) -> Result<(), WebDriverError> {
        self.session_call(
            "POST",
            &format!("/element/{}/clear", element.0),
            Some(json!({})),
        )
        .map(drop)
    }

    /// Types `text` into `element`, key by key, as a person would.
    pub fn send_keys(&self, element: &Element, text: &str) -> Result<(), WebDriverError> {
        self.session_call(
            "POST",
            &format!("/element/{}/value", element.0),
            Some(json!({ "text": text })),
        )
        .map(drop)
    }

    /// Clicks `element`.
    pub fn click(&self, element: &Element) -> Result<(), WebDriverError> {
        self.session_call(
            "POST",
            &format!("/element/{}/click", element.0),
            Some(json!({})),
        )
        .map(drop)
    }

    /// Runs `script` (a function body; `arguments` are `args`) in the page; what it returns.
    pub fn execute(&self, script: &str, args: Value) -> Result<Value, WebDriverError> {
        self.session_call(
            "POST",
            "/execute/sync",
            Some(json!({"script": script, "args": args})),
        )
    }

    /// The page's DOM as it is now.
    pub fn dom(&self) -> Result<String, WebDriverError> {
        let v = self.execute("return document.documentElement.outerHTML;", json!([]))?;
        v.as_str()
            .map(str::to_owned)
            .ok_or_else(|| WebDriverError::Shape("outerHTML".into(), "string"))
    }

    /// Polls `script` until it returns a non-null value, for at most `timeout`; that value.
    pub fn wait_for(
        &self,
        what: &str,
        script: &str,
        timeout: Duration,
    ) -> Result<Value, WebDriverError> {
        let start = Instant::now();
        loop {
            let v = self.execute(script, json!([]))?;
            if !v.is_null() {
                return Ok(v);
            }
            if start.elapsed() > timeout {
                return Err(WebDriverError::Timeout(timeout, what.to_owned()));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        if !self.session.is_empty() {
            let _ = self.session_call("DELETE", "", None);
        }
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}
