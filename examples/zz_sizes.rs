use axum::body::Body;
use axum::routing::get;
use axum::Router;
use http::Request;
use std::time::Duration;
use tower::{Service, ServiceBuilder};
use tower_admission::bounds::{BodyLimitsLayer, QueryRules, ValidateQueryLayer};
use tower_admission::concurrency::ConcurrencyLayer;
use tower_admission::identity::{ApiKeys, AuthenticateLayer, Identity};
use tower_admission::quota::{MemoryStore, Policy, Quota, QuotaLayer, Scope};
fn sz<T>(name: &str, svc: &T, fut: &impl std::any::Any) { let _ = svc; println!("{name}: service {} future {}", std::mem::size_of::<T>(), std::mem::size_of_val(fut)); }
fn main() {
    let router = || Router::new().route("/", get(|| async { "ok" })).with_state::<()>(());
    let q = || Quota::new("q", [Policy::token_bucket("b", 1000, 1000, Duration::from_secs(1)).unwrap()]).unwrap();
    let quota = || QuotaLayer::builder(MemoryStore::new()).quota(q()).scope(Scope::Aggregate).build().unwrap();
    let conc = || ConcurrencyLayer::builder().global(10, 10, Duration::from_secs(1)).build().unwrap();
    let rules = || QueryRules::builder().build().unwrap();
    let auth = || AuthenticateLayer::new(ApiKeys::new().with_key("k", Identity::new("a", "b", "c")));
    macro_rules! m { ($name:expr, $svc:expr) => {{ let mut s = $svc; let f = s.call(Request::new(Body::empty())); sz($name, &s, &f); }} }
    m!("route", router());
    m!("conc", ServiceBuilder::new().layer(conc()).service(router()));
    m!("quota", ServiceBuilder::new().layer(quota()).service(router()));
    m!("quota+conc", ServiceBuilder::new().layer(quota()).layer(conc()).service(router()));
    m!("quota2+conc", ServiceBuilder::new().layer(quota()).layer(quota()).layer(conc()).service(router()));
    m!("query+..", ServiceBuilder::new().layer(ValidateQueryLayer::new(rules())).layer(quota()).layer(quota()).layer(conc()).service(router()));
    m!("body+..", ServiceBuilder::new().layer(BodyLimitsLayer::new(1<<20, 8<<20)).layer(ValidateQueryLayer::new(rules())).layer(quota()).layer(quota()).layer(conc()).service(router()));
    m!("auth+..", ServiceBuilder::new().layer(auth()).layer(BodyLimitsLayer::new(1<<20, 8<<20)).layer(ValidateQueryLayer::new(rules())).layer(quota()).layer(quota()).layer(conc()).service(router()));
    m!("auth", ServiceBuilder::new().layer(auth()).service(router()));
    m!("body", ServiceBuilder::new().layer(BodyLimitsLayer::new(1<<20, 8<<20)).service(router()));
    m!("query", ServiceBuilder::new().layer(ValidateQueryLayer::new(rules())).service(router()));
}
