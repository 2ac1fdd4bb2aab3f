//! Filter-defined metrics: counters, gauges and histograms, process-wide by name.
//!
//! As in Envoy, a metric id carries its type in the low two bits, defining the same name and type
//! again (from any VM) returns the same metric, and the statuses follow Envoy's `Context`:
//! counters only grow (`increment` with an offset <= 0 is `BadArgument`), gauges are set by
//! `record` and moved by `increment`, histograms only take `record` and cannot be read back by the
//! guest (`get` is `BadArgument`). The harness keeps every recorded histogram value for tests.

use std::collections::HashMap;

use crate::types::{MetricType, Status};

/// One metric's current state, as tests see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Metric {
    pub name: String,
    pub kind: MetricType,
    /// Counter total or gauge value (0 for histograms).
    pub value: i64,
    /// Every value recorded into a histogram, in order (empty for counters and gauges).
    pub samples: Vec<u64>,
}

/// The metric store of one process.
#[derive(Debug, Default)]
pub struct Metrics {
    ids: HashMap<(MetricType, String), u32>,
    metrics: Vec<Metric>,
}

impl Metrics {
    /// Defines (or finds) a metric and returns its id.
    pub fn define(&mut self, kind: MetricType, name: &str) -> u32 {
        let key = (kind, name.to_owned());
        if let Some(&id) = self.ids.get(&key) {
            return id;
        }
        let index = u32::try_from(self.metrics.len()).unwrap_or(u32::MAX >> 2);
        let id = (index << 2) | kind as u32;
        self.metrics.push(Metric {
            name: name.to_owned(),
            kind,
            value: 0,
            samples: Vec::new(),
        });
        self.ids.insert(key, id);
        id
    }

    /// `proxy_increment_metric`.
    pub fn increment(&mut self, id: u32, offset: i64) -> Result<(), Status> {
        let metric = self.lookup(id)?;
        match metric.kind {
            MetricType::Counter if offset > 0 => metric.value = metric.value.saturating_add(offset),
            MetricType::Counter | MetricType::Histogram => return Err(Status::BadArgument),
            MetricType::Gauge => metric.value = metric.value.saturating_add(offset),
        }
        Ok(())
    }

    /// `proxy_record_metric`: adds to a counter, sets a gauge, records a histogram sample.
    pub fn record(&mut self, id: u32, value: u64) -> Result<(), Status> {
        let metric = self.lookup(id)?;
        let signed = i64::try_from(value).unwrap_or(i64::MAX);
        match metric.kind {
            MetricType::Counter => metric.value = metric.value.saturating_add(signed),
            MetricType::Gauge => metric.value = signed,
            MetricType::Histogram => metric.samples.push(value),
        }
        Ok(())
    }

    /// `proxy_get_metric`.
    pub fn get(&mut self, id: u32) -> Result<u64, Status> {
        let metric = self.lookup(id)?;
        match metric.kind {
            // Gauges are unsigned in Envoy; a negative harness gauge reads back as its bit pattern.
            MetricType::Counter | MetricType::Gauge => Ok(metric.value as u64),
            MetricType::Histogram => Err(Status::BadArgument),
        }
    }

    /// A metric by name and kind.
    pub fn find(&self, kind: MetricType, name: &str) -> Option<&Metric> {
        let id = self.ids.get(&(kind, name.to_owned()))?;
        self.metrics.get((id >> 2) as usize)
    }

    /// All metrics in definition order.
    pub fn all(&self) -> &[Metric] {
        &self.metrics
    }

    fn lookup(&mut self, id: u32) -> Result<&mut Metric, Status> {
        let metric = self
            .metrics
            .get_mut((id >> 2) as usize)
            .ok_or(Status::NotFound)?;
        if metric.kind as u32 != id & 3 {
            return Err(Status::NotFound);
        }
        Ok(metric)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_name_same_metric_across_definitions() {
        let mut metrics = Metrics::default();
        let a = metrics.define(MetricType::Counter, "kvoy_requests");
        let b = metrics.define(MetricType::Counter, "kvoy_requests");
        let g = metrics.define(MetricType::Gauge, "kvoy_requests");
        assert_eq!(a, b);
        assert_ne!(a, g, "a different type is a different metric");
        metrics.increment(a, 2).expect("counter");
        metrics.increment(b, 3).expect("counter");
        assert_eq!(metrics.get(a), Ok(5));
        assert_eq!(
            metrics
                .find(MetricType::Counter, "kvoy_requests")
                .map(|m| m.value),
            Some(5)
        );
    }

    #[test]
    fn envoy_statuses_per_kind() {
        let mut metrics = Metrics::default();
        let counter = metrics.define(MetricType::Counter, "c");
        let gauge = metrics.define(MetricType::Gauge, "g");
        let histogram = metrics.define(MetricType::Histogram, "h");

        assert_eq!(metrics.increment(counter, 0), Err(Status::BadArgument));
        assert_eq!(metrics.increment(counter, -1), Err(Status::BadArgument));
        metrics
            .record(counter, 4)
            .expect("record adds to a counter");
        assert_eq!(metrics.get(counter), Ok(4));

        metrics.record(gauge, 10).expect("set");
        metrics.increment(gauge, -3).expect("gauges go down");
        assert_eq!(metrics.get(gauge), Ok(7));

        metrics.record(histogram, 5).expect("sample");
        metrics.record(histogram, 9).expect("sample");
        assert_eq!(metrics.increment(histogram, 1), Err(Status::BadArgument));
        assert_eq!(metrics.get(histogram), Err(Status::BadArgument));
        assert_eq!(
            metrics
                .find(MetricType::Histogram, "h")
                .map(|m| m.samples.clone()),
            Some(vec![5, 9])
        );

        assert_eq!(metrics.get(999), Err(Status::NotFound));
        // Right index, wrong type bits.
        assert_eq!(metrics.get(counter | 1), Err(Status::NotFound));
    }
}
