//! Store builders: one store per bucket, container or web origin of a call, built once and shared.

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::azure::{AzureConfigKey, MicrosoftAzureBuilder};
use object_store::gcp::{GoogleCloudStorageBuilder, GoogleConfigKey};
use object_store::http::HttpBuilder;
use object_store::list::PaginatedListStore;
use object_store::path::Path as Key;
use object_store::{BackoffConfig, ClientConfigKey, ClientOptions, ObjectStore, RetryConfig};
use tokio::sync::Semaphore;

use super::credentials::{aws_profile, hf_token};
use super::redirect::Credentialed;
use super::url::{invalid, parse_url, Kind, Parsed};
use super::{ObjectStat, RemoteOptions};
use crate::error::{AdapterErrorCode, Error};

/// One store (bucket, container or web origin) of a call.
pub(super) struct Store {
    pub(super) inner: Arc<dyn ObjectStore>,
    /// Object stores list prefixes; web servers cannot.
    pub(super) listable: bool,
    /// The store's listing one page at a time (S3, GCS, Azure), so that a listing can start with a
    /// short page and header reads with it.
    pub(super) pages: Option<Arc<dyn PaginatedListStore>>,
    /// Timeouts in a row, with no success in between.
    pub(super) stalls: AtomicUsize,
    /// Set once the server answered a range request with the whole object.
    pub(super) ignores_range: AtomicBool,
    /// The longest safetensors header (length prefix included) read from this store, 0 before the
    /// first: it sizes the first range request of the next ones ([`super::first_read_size`]).
    pub(super) longest_header: AtomicU64,
}

/// An object: its store, its key there and its URL (as shown in results).
pub(super) struct Loc {
    pub(super) store: Arc<Store>,
    pub(super) key: Key,
    pub(super) url: String,
}

/// Why a store could not be built: (error code, message), given to every adapter in it.
pub(super) type StoreError = (AdapterErrorCode, String);

/// State shared by the requests of one call.
pub(super) struct Remote {
    pub(super) opts: RemoteOptions,
    pub(super) stores: Mutex<HashMap<String, Result<Arc<Store>, StoreError>>>,
    pub(super) permits: Semaphore,
    /// What the listings of this call said about each object, by URL (for `Remote::stat`); kept only
    /// once `keep_listed` is set, so a plain scan does not hold a map of its whole listing.
    pub(super) listed: Mutex<HashMap<String, ObjectStat>>,
    pub(super) keep_listed: AtomicBool,
    /// Sizes of the listed `.safetensors` objects of at most [`super::SPECULATIVE_BYTES`], by URL:
    /// those the first header read takes whole ([`super::first_read_size`]). Larger ones are not
    /// kept, so a plain scan holds no map of its whole listing.
    pub(super) small_objects: Mutex<HashMap<String, u64>>,
}

/// A built store, and its paginated listing where it has one.
type Built = (Arc<dyn ObjectStore>, Option<Arc<dyn PaginatedListStore>>);

/// `store` as both an object store and a paginated listing.
fn listing<S: ObjectStore + PaginatedListStore>(store: S) -> Built {
    let store = Arc::new(store);
    (store.clone(), Some(store))
}

fn store_error(e: impl std::fmt::Display) -> StoreError {
    (AdapterErrorCode::StoreConfig, e.to_string())
}

impl Remote {
    pub(super) fn new(opts: &RemoteOptions) -> Self {
        Remote {
            opts: opts.clone(),
            stores: Mutex::new(HashMap::new()),
            permits: Semaphore::new(opts.concurrency.max(1)),
            listed: Mutex::new(HashMap::new()),
            keep_listed: AtomicBool::new(false),
            small_objects: Mutex::new(HashMap::new()),
        }
    }

    fn retry(&self) -> RetryConfig {
        RetryConfig {
            backoff: BackoffConfig {
                init_backoff: Duration::from_millis(50),
                max_backoff: Duration::from_secs(2),
                base: 2.0,
            },
            max_retries: self.opts.retries,
            // One retry after a timeout at most: a stalled server costs ~2 timeouts, not minutes.
            retry_timeout: self.opts.timeout.saturating_mul(2),
        }
    }

    fn millis(d: Duration) -> String {
        format!("{}ms", d.as_millis().max(1))
    }

    fn client_defaults(&self) -> [(ClientConfigKey, String); 2] {
        let connect = self.opts.timeout.min(Duration::from_secs(5));
        [
            (ClientConfigKey::Timeout, Self::millis(self.opts.timeout)),
            (ClientConfigKey::ConnectTimeout, Self::millis(connect)),
        ]
    }

    /// The headers sent to a web server or the Hub: the `headers` storage option (a JSON object of
    /// names to values) and, for the Hub, `Authorization: Bearer` with the `token` option or else
    /// the environment's token (a `headers` Authorization wins). All of them are credentials: they
    /// go to this origin only, never to a host a redirect names ([`Credentialed`]).
    fn web_headers(&self, hub: bool) -> Result<reqwest::header::HeaderMap, StoreError> {
        use reqwest::header::{HeaderMap, HeaderName, HeaderValue, AUTHORIZATION};
        let bad = |why: String| (AdapterErrorCode::StoreConfig, format!("storage option headers: {why}"));
        let mut headers = HeaderMap::new();
        let option = |name: &str| self.opts.storage_options.iter().rev().find(|(k, _)| k == name);
        if let Some((_, text)) = option("headers") {
            let map: serde_json::Map<String, serde_json::Value> = serde_json::from_str(text)
                .map_err(|_| bad("expected a JSON object of header names to values".to_owned()))?;
            for (name, value) in map {
                let value = match value {
                    serde_json::Value::String(v) => v,
                    other => other.to_string(),
                };
                let key =
                    HeaderName::from_bytes(name.as_bytes()).map_err(|_| bad(format!("bad header name {name:?}")))?;
                let mut value =
                    HeaderValue::from_str(&value).map_err(|_| bad(format!("bad value for header {name}")))?;
                value.set_sensitive(true);
                headers.insert(key, value);
            }
        }
        let token = option("token")
            .map(|(_, t)| t.trim().to_owned())
            .filter(|t| !t.is_empty());
        if hub && !headers.contains_key(AUTHORIZATION) {
            if let Some(token) = token.or_else(hf_token) {
                let mut value = HeaderValue::from_str(&format!("Bearer {token}")).map_err(|_| {
                    (
                        AdapterErrorCode::StoreConfig,
                        "the Hugging Face token is not a valid header value".to_owned(),
                    )
                })?;
                value.set_sensitive(true);
                headers.insert(AUTHORIZATION, value);
            }
        }
        Ok(headers)
    }

    fn build(&self, p: &Parsed) -> Result<Built, StoreError> {
        let user = &self.opts.storage_options;
        // GCS and Azure take the same steps, each with its own builder and key types.
        macro_rules! configured {
            ($builder:ident, $key:ident) => {{
                let mut b = $builder::from_env().with_url(&p.base).with_retry(self.retry());
                for (k, v) in self.client_defaults() {
                    b = b.with_config($key::Client(k), v);
                }
                for (k, v) in user {
                    b = b.with_config($key::from_str(k).map_err(store_error)?, v);
                }
                Ok(listing(b.build().map_err(store_error)?))
            }};
        }
        let user_sets = |names: &[&str]| user.iter().any(|(k, _)| names.contains(&k.as_str()));
        match p.kind {
            Kind::S3 => {
                let mut b = AmazonS3Builder::from_env().with_url(&p.base).with_retry(self.retry());
                for (k, v) in self.client_defaults() {
                    b = b.with_config(AmazonS3ConfigKey::Client(k), v);
                }
                if b.get_config_value(&AmazonS3ConfigKey::AccessKeyId).is_none() {
                    for (k, v) in aws_profile() {
                        if b.get_config_value(&k).is_none() {
                            b = b.with_config(k, v);
                        }
                    }
                }
                for (k, v) in user {
                    b = b.with_config(AmazonS3ConfigKey::from_str(k).map_err(store_error)?, v);
                }
                // An endpoint the user wrote as http:// is meant: allow it.
                let http_endpoint = b
                    .get_config_value(&AmazonS3ConfigKey::Endpoint)
                    .is_some_and(|e| e.starts_with("http://"));
                if http_endpoint && !user_sets(&["allow_http", "aws_allow_http"]) {
                    b = b.with_allow_http(true);
                }
                Ok(listing(b.build().map_err(store_error)?))
            }
            Kind::Gcs => configured!(GoogleCloudStorageBuilder, GoogleConfigKey),
            Kind::Azure => configured!(MicrosoftAzureBuilder, AzureConfigKey),
            Kind::Http | Kind::HuggingFace => {
                let allow_http = p.base.starts_with("http://");
                let mut options = ClientOptions::new().with_allow_http(allow_http);
                for (k, v) in self.client_defaults() {
                    options = options.with_config(k, v);
                }
                // Store-specific keys (endpoint, region, ...) do not apply to a web server.
                for (k, v) in user {
                    if let Ok(key) = ClientConfigKey::from_str(k) {
                        options = options.with_config(key, v);
                    }
                }
                let mut b = HttpBuilder::new()
                    .with_url(&p.base)
                    .with_retry(self.retry())
                    .with_client_options(options);
                let credentials = self.web_headers(p.kind == Kind::HuggingFace)?;
                if !credentials.is_empty() {
                    // Redirects followed by lorafast, so that no hop off this origin gets them.
                    b = b.with_http_connector(Credentialed::new(credentials, self.opts.timeout, allow_http, user)?);
                }
                Ok((Arc::new(b.build().map_err(store_error)?), None))
            }
        }
    }

    pub(super) fn loc(&self, url: &str) -> Result<Loc, Error> {
        let p = parse_url(url)?;
        let key = Key::from_url_path(&p.key).map_err(|e| invalid(url, format!("bad object path: {e}")))?;
        let store = {
            let mut stores = self.stores.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            stores
                .entry(p.base.clone())
                .or_insert_with(|| {
                    self.build(&p).map(|(inner, pages)| {
                        Arc::new(Store {
                            inner,
                            listable: !matches!(p.kind, Kind::Http | Kind::HuggingFace),
                            pages,
                            stalls: AtomicUsize::new(0),
                            ignores_range: AtomicBool::new(false),
                            longest_header: AtomicU64::new(0),
                        })
                    })
                })
                .clone()
        };
        let store = store.map_err(|(code, message)| Error::adapter(url, code, message))?;
        Ok(Loc {
            store,
            key,
            url: url.to_owned(),
        })
    }
}
