//! Sampling parameters resolved against the core's typed defaults and ranges.

use helios_contract::{SamplingDefaults, SamplingParameter};

use crate::error::SamplingError;

/// What a request asked for; `None` takes the core's default.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SamplingRequest {
    pub temperature: Option<f64>,
    pub top_k: Option<f64>,
    pub top_p: Option<f64>,
    pub min_p: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub max_output_tokens: Option<u32>,
}

/// Effective parameters. Invariant: `temperature > 0`, every value finite and inside
/// the core's range (greedy requests aside: temperature 1 and top-k 1, see
/// [`resolve_sampling`]), `1 <= max_output_tokens <= cap` (the deployment's output cap).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ResolvedSampling {
    pub temperature: f64,
    pub top_k: u32,
    pub top_p: f64,
    pub min_p: f64,
    pub repetition_penalty: f64,
    pub presence_penalty: f64,
    pub frequency_penalty: f64,
    pub max_output_tokens: u32,
}

fn finite(name: &'static str, v: Option<f64>) -> Result<Option<f64>, SamplingError> {
    match v {
        Some(x) if !x.is_finite() => Err(SamplingError::NotFinite { name }),
        other => Ok(other),
    }
}

fn pick(name: &'static str, p: &SamplingParameter, v: Option<f64>) -> Result<f64, SamplingError> {
    Ok(p.resolve(finite(name, v)?))
}

/// Clamps the request into the core's ranges. A requested temperature of 0 is greedy
/// decoding, as OpenAI-compatible servers treat it: temperature 1 and top-k 1, so the device
/// sampler keeps only the most probable token (exact ties all kept, drawn by the seed);
/// penalties still apply. A negative temperature, or a non-positive resolved one, is
/// rejected. The output limit is the request's, else the core's default
/// (`d.max_output_tokens`), clamped to `cap`, the deployment's stated output cap.
pub fn resolve_sampling(
    d: &SamplingDefaults,
    r: &SamplingRequest,
    cap: u32,
) -> Result<ResolvedSampling, SamplingError> {
    let greedy = match finite("temperature", r.temperature)? {
        Some(t) if t < 0.0 => return Err(SamplingError::NonPositiveTemperature(t)),
        Some(t) => t == 0.0,
        None => false,
    };
    let temperature = if greedy { 1.0 } else { pick("temperature", &d.temperature, r.temperature)? };
    if temperature <= 0.0 {
        return Err(SamplingError::NonPositiveTemperature(temperature));
    }
    let max_output_tokens = match r.max_output_tokens {
        Some(0) => return Err(SamplingError::ZeroMaxTokens),
        Some(n) => n.min(cap),
        None => d.max_output_tokens.min(cap),
    };
    if max_output_tokens == 0 {
        return Err(SamplingError::ZeroMaxTokens);
    }
    let top_k =
        if greedy { 1 } else { pick("top_k", &d.top_k, r.top_k)?.round().clamp(0.0, f64::from(u32::MAX)) as u32 };
    Ok(ResolvedSampling {
        temperature,
        top_k,
        top_p: pick("top_p", &d.top_p, r.top_p)?,
        min_p: pick("min_p", &d.min_p, r.min_p)?,
        repetition_penalty: pick("repetition_penalty", &d.repetition_penalty, r.repetition_penalty)?,
        presence_penalty: pick("presence_penalty", &d.presence_penalty, r.presence_penalty)?,
        frequency_penalty: pick("frequency_penalty", &d.frequency_penalty, r.frequency_penalty)?,
        max_output_tokens,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(default: f64, lo: f64, hi: f64) -> SamplingParameter {
        SamplingParameter { default, range: Some((lo, hi)) }
    }

    fn defaults() -> SamplingDefaults {
        SamplingDefaults {
            temperature: p(0.7, 0.01, 2.0),
            top_k: p(20.0, 0.0, 100.0),
            top_p: p(0.8, 0.0, 1.0),
            min_p: SamplingParameter { default: 0.0, range: None },
            repetition_penalty: p(1.0, 1.0, 2.0),
            presence_penalty: p(0.0, -2.0, 2.0),
            frequency_penalty: p(0.0, -2.0, 2.0),
            max_output_tokens: 4096,
        }
    }

    #[test]
    fn defaults_and_clamping() {
        let d = defaults();
        let r = resolve_sampling(&d, &SamplingRequest::default(), 8192).expect("valid");
        assert_eq!((r.temperature, r.top_k, r.top_p, r.max_output_tokens), (0.7, 20, 0.8, 4096));
        // The core's default applies only when the request is silent; the cap bounds both.
        let req = SamplingRequest { max_output_tokens: Some(6000), ..Default::default() };
        assert_eq!(resolve_sampling(&d, &req, 8192).expect("valid").max_output_tokens, 6000);
        assert_eq!(resolve_sampling(&d, &SamplingRequest::default(), 1000).expect("valid").max_output_tokens, 1000);
        let req = SamplingRequest {
            temperature: Some(5.0),
            top_k: Some(1000.0),
            min_p: Some(0.5),
            max_output_tokens: Some(99_999),
            ..Default::default()
        };
        let r = resolve_sampling(&d, &req, 4096).expect("valid");
        assert_eq!((r.temperature, r.top_k, r.min_p, r.max_output_tokens), (2.0, 100, 0.0, 4096));
    }

    #[test]
    fn zero_temperature_is_greedy_and_negative_rejected() {
        let d = defaults();
        // Below the core's temperature range (0.01..): greedy, not clamped to 0.01.
        let req = SamplingRequest { temperature: Some(0.0), top_k: Some(50.0), ..Default::default() };
        let r = resolve_sampling(&d, &req, 4096).expect("greedy");
        assert_eq!((r.temperature, r.top_k, r.top_p), (1.0, 1, 0.8));
        let req = SamplingRequest { temperature: Some(-0.5), ..Default::default() };
        assert_eq!(resolve_sampling(&d, &req, 4096), Err(SamplingError::NonPositiveTemperature(-0.5)));
        let req = SamplingRequest { top_p: Some(f64::NAN), ..Default::default() };
        assert_eq!(resolve_sampling(&d, &req, 4096), Err(SamplingError::NotFinite { name: "top_p" }));
        let mut d0 = d;
        d0.temperature = SamplingParameter { default: 0.0, range: None };
        assert!(resolve_sampling(&d0, &SamplingRequest::default(), 4096).is_err());
    }
}
