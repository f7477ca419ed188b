//! Credentials kept on their origin. A web server or the Hub given credentials (the Hub token, the
//! `headers` storage option) is reached through [`Credentialed`], which follows redirects itself.
//! reqwest's own policy is not enough: on each hop tower-http sends the first request's headers
//! again, and reqwest drops `Authorization` only when that hop changes origin from the hop before
//! it, so a chain A -> B -> B (another host, then a redirect within it) handed A's token to B.
//! Here the credentials go to the URL's own origin only: once a hop leaves it (another scheme, host
//! or port), they are dropped for the rest of the chain, whatever it comes back to.

use std::future::Future;
use std::pin::Pin;
use std::str::FromStr;
use std::time::Duration;

use object_store::client::{
    ClientOptions, HttpClient, HttpConnector, HttpError, HttpErrorKind, HttpRequest, HttpResponse, HttpService,
};
use object_store::ClientConfigKey;
use reqwest::header::{HeaderMap, LOCATION};
use reqwest::{Method, StatusCode};

use super::stores::StoreError;
use crate::error::AdapterErrorCode;

/// Redirects followed in a row at most (reqwest's default).
const MAX_REDIRECTS: usize = 10;

/// An object_store HTTP client (and its connector) that sends `credentials` with every request to
/// the store's origin and follows redirects without them once a hop leaves it.
#[derive(Debug, Clone)]
pub(super) struct Credentialed {
    /// Follows no redirect itself.
    client: HttpClient,
    credentials: HeaderMap,
}

impl Credentialed {
    /// `user` is the call's storage options: the client keys that apply to a web server are
    /// honoured, any other client key is refused (this client is built here, not by object_store).
    pub(super) fn new(
        credentials: HeaderMap,
        timeout: Duration,
        mut allow_http: bool,
        user: &[(String, String)],
    ) -> Result<Self, StoreError> {
        let bad = |why: String| (AdapterErrorCode::StoreConfig, why);
        let flag = |k: &str, v: &str| match v.to_ascii_lowercase().as_str() {
            "true" | "1" | "yes" | "on" => Ok(true),
            "false" | "0" | "no" | "off" => Ok(false),
            _ => Err(bad(format!("storage option {k}: expected true or false, not {v:?}"))),
        };
        let mut b = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(concat!("lorafast/", env!("CARGO_PKG_VERSION")))
            .timeout(timeout)
            .connect_timeout(timeout.min(Duration::from_secs(5)));
        let (mut proxy, mut excludes) = (None, None);
        for (k, v) in user {
            let Ok(key) = ClientConfigKey::from_str(k) else {
                continue; // store keys (endpoint, region, ...) do not apply to a web server
            };
            match key {
                ClientConfigKey::AllowHttp => allow_http = flag(k, v)?,
                ClientConfigKey::AllowInvalidCertificates => b = b.danger_accept_invalid_certs(flag(k, v)?),
                ClientConfigKey::UserAgent => b = b.user_agent(v.as_str()),
                ClientConfigKey::ProxyUrl => proxy = Some(v),
                ClientConfigKey::ProxyExcludes => excludes = Some(v),
                _ => {
                    return Err(bad(format!(
                        "storage option {k} is not supported for a web server given credentials (token or \
                         headers); these are: allow_http, allow_invalid_certificates, user_agent, proxy_url, \
                         proxy_excludes, and the timeout argument"
                    )))
                }
            }
        }
        if let Some(url) = proxy {
            let p = reqwest::Proxy::all(url.as_str()).map_err(|e| bad(format!("storage option proxy_url: {e}")))?;
            b = b.proxy(p.no_proxy(excludes.and_then(|e| reqwest::NoProxy::from_string(e))));
        }
        let client = b.https_only(!allow_http).build().map_err(|e| bad(e.to_string()))?;
        Ok(Credentialed {
            client: HttpClient::new(client),
            credentials,
        })
    }

    async fn follow(&self, mut req: HttpRequest) -> Result<HttpResponse, HttpError> {
        let home = url_of(req.uri())?;
        req.headers_mut().extend(self.credentials.clone());
        for _ in 0..=MAX_REDIRECTS {
            let (method, at, mut headers, body) = (
                req.method().clone(),
                url_of(req.uri())?,
                req.headers().clone(),
                req.body().clone(),
            );
            let resp = self.client.execute(req).await?;
            let location = match resp.headers().get(LOCATION) {
                Some(l) if is_redirect(resp.status()) => {
                    l.to_str().map_err(|_| refused("a Location that is not text"))?
                }
                _ => return Ok(resp),
            };
            let next = at
                .join(location)
                .map_err(|e| refused(&format!("a bad Location {location:?}: {e}")))?;
            if next.origin() != home.origin() {
                for name in self.credentials.keys() {
                    headers.remove(name);
                }
            }
            req = HttpRequest::new(body);
            // 303 means "GET the answer there"; object_store's reads are GETs and HEADs anyway.
            *req.method_mut() = if resp.status() == StatusCode::SEE_OTHER && method != Method::HEAD {
                Method::GET
            } else {
                method
            };
            *req.uri_mut() = next
                .as_str()
                .parse()
                .map_err(|_| refused("a Location that is no URI"))?;
            *req.headers_mut() = headers;
        }
        Err(refused(&format!("more than {MAX_REDIRECTS} redirects")))
    }
}

/// The statuses that send a client elsewhere (not 300, 304 or 305, which reqwest does not follow either).
fn is_redirect(status: StatusCode) -> bool {
    matches!(status.as_u16(), 301 | 302 | 303 | 307 | 308)
}

fn url_of(uri: &impl std::fmt::Display) -> Result<url::Url, HttpError> {
    url::Url::parse(&uri.to_string()).map_err(|e| refused(&format!("a request URL it cannot parse: {e}")))
}

/// A redirect that is not followed (not retried either: the same answer would come again).
fn refused(why: &str) -> HttpError {
    HttpError::new(
        HttpErrorKind::Unknown,
        std::io::Error::other(format!("redirect not followed: {why}")),
    )
}

impl HttpService for Credentialed {
    // What `#[async_trait]` makes of object_store's `async fn call`.
    fn call<'s, 'f>(
        &'s self,
        req: HttpRequest,
    ) -> Pin<Box<dyn Future<Output = Result<HttpResponse, HttpError>> + Send + 'f>>
    where
        's: 'f,
        Self: 'f,
    {
        Box::pin(self.follow(req))
    }
}

impl HttpConnector for Credentialed {
    fn connect(&self, _: &ClientOptions) -> object_store::Result<HttpClient> {
        Ok(HttpClient::new(self.clone()))
    }
}
