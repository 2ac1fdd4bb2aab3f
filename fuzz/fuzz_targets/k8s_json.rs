//! The Kubernetes API objects the aggregator reads (`kvoy_aggregator::k8s`): an InferencePool
//! and a PodList, then the endpoints they select. The input is used as both bodies (seeds hold
//! a `spec` and `items` side by side), so one input can reach `select_endpoints`.
//!
//! Beyond "no panic":
//! - what the decoders keep agrees with serde_json's reading of the same body (selector,
//!   ports, pod names and IPs), and a pool always has a selector and valid, unique ports;
//! - the endpoints selected are sorted and unique, at most `MAX_ENDPOINTS`, each a member pod's
//!   IP at a target port, and every member pod at every target port is there;
//! - the label selector query is percent-encoded and decodes back to `k=v,k=v`.
#![no_main]

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};

use kvoy_aggregator::k8s::{
    label_selector_query, parse_pods, parse_pool, select_endpoints, KubernetesConfig, KvEventPorts,
};
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

fn percent_decode(s: &str) -> Option<Vec<u8>> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            let c = b[i];
            if !(c.is_ascii_alphanumeric() || b"-_.~".contains(&c)) {
                return None;
            }
            out.push(c);
            i += 1;
        }
    }
    Some(out)
}

fuzz_target!(|data: &[u8]| {
    // serde also reads a struct from an array of its fields (`[[]]` is a PodList without
    // items): compare with serde_json's reading only for objects.
    let value: Option<Value> = serde_json::from_slice(data).ok().filter(Value::is_object);
    let pool = parse_pool(data);
    if let Ok(pool) = &pool {
        assert!(!pool.selector.is_empty() && !pool.target_ports.is_empty());
        let unique: BTreeSet<u16> = pool.target_ports.iter().copied().collect();
        assert_eq!(unique.len(), pool.target_ports.len());
        assert!(!unique.contains(&0));
        let spec = value.as_ref().map(|v| &v["spec"]);
        let ports = spec
            .and_then(|s| s["targetPorts"].as_array())
            .filter(|ps| ps.iter().all(Value::is_object));
        let labels = spec.and_then(|s| s["selector"]["matchLabels"].as_object());
        if let (Some(ports), Some(labels)) = (ports, labels) {
            let ports: BTreeSet<u16> = ports
                .iter()
                .filter_map(|p| p["number"].as_u64())
                .filter_map(|n| u16::try_from(n).ok())
                .collect();
            assert_eq!(ports, unique);
            assert_eq!(labels.len(), pool.selector.len());
            for (k, l) in &pool.selector {
                assert_eq!(labels.get(k).and_then(Value::as_str), Some(l.as_str()));
            }
        }

        let query = label_selector_query(&pool.selector);
        let decoded = percent_decode(&query).expect("percent-encoded query");
        let joined: Vec<String> = pool
            .selector
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        assert_eq!(decoded, joined.join(",").into_bytes());
    }
    let pods = parse_pods(data);
    if let Ok(pods) = &pods {
        if let Some(items) = value.as_ref().and_then(|v| v["items"].as_array()) {
            assert_eq!(items.len(), pods.len());
            for (pod, item) in pods.iter().zip(items) {
                // Only objects all the way down (see above).
                let plain = |v: &Value| v.is_object() || v.is_null();
                if !(item.is_object() && plain(&item["metadata"]) && plain(&item["status"])) {
                    continue;
                }
                let name = item["metadata"]["name"].as_str().unwrap_or_default();
                assert_eq!(pod.name, name);
                let ip: Option<IpAddr> = item["status"]["podIP"]
                    .as_str()
                    .and_then(|s| s.trim().parse().ok());
                assert_eq!(pod.ip, ip);
            }
        }
    }
    let (Ok(pool), Ok(pods)) = (pool, pods) else {
        return;
    };
    let mut cfg = KubernetesConfig::for_pool("pool", &["m"]);
    cfg.kv_events = Some(KvEventPorts {
        port: data.len() as u16,
        replay_port: Some(u16::MAX - 1),
        topic: String::new(),
    });
    let Ok(endpoints) = select_endpoints(&pool, &pods, &cfg) else {
        return;
    };
    assert!(endpoints.len() <= kvoy_shared::MAX_ENDPOINTS);
    assert!(endpoints.windows(2).all(|w| w[0].address < w[1].address));
    let expected: BTreeSet<SocketAddr> = pods
        .iter()
        .filter(|p| p.is_member(&pool.selector))
        .filter_map(|p| p.ip)
        .flat_map(|ip| {
            pool.target_ports
                .iter()
                .map(move |&port| SocketAddr::new(ip, port))
        })
        .collect();
    let got: BTreeSet<SocketAddr> = endpoints.iter().map(|e| e.address).collect();
    assert_eq!(got, expected);
    for e in &endpoints {
        if let Some(kv) = &e.kv_events {
            assert!(kv.endpoint.starts_with("tcp://"));
        }
    }
});
