//! Builders for the ext_proc messages the EPP sends (envoy-ext-proc.md §3, gaie-epp-protocol.md §5):
//! header mutations with values in `raw_value`, `envoy.lb` dynamic metadata, streamed body chunks
//! of at most 62,000 bytes, and immediate responses with OpenAI-shaped JSON bodies.

use std::collections::HashMap;

use envoy_types::pb::envoy::config::core::v3::{
    header_value_option::HeaderAppendAction, HeaderValue, HeaderValueOption,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, processing_response, BodyMutation, BodyResponse, CommonResponse, HeaderMutation,
    HeadersResponse, ImmediateResponse, ProcessingResponse, StreamedBodyResponse, TrailersResponse,
};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};

/// GAIE's chunk limit: Envoy's gRPC messages near 64 KiB hit RESOURCE_EXHAUSTED (GAIE #2056).
pub const MAX_CHUNK: usize = 62_000;

pub const DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";
pub const LB_NAMESPACE: &str = "envoy.lb";
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";
pub const SERVED_KEY: &str = "x-gateway-destination-endpoint-served";

pub fn set_header(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_string(),
            value: String::new(),
            raw_value: value.as_bytes().to_vec(),
        }),
        // Overwrite: a client must not be able to pre-set a routing header and have ours appended.
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..Default::default()
    }
}

fn string_value(s: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(s.to_string())),
    }
}

/// `{"envoy.lb": {"x-gateway-destination-endpoint": "<list>"}}`.
pub fn destination_metadata(destinations: &str) -> Struct {
    let inner = Struct {
        fields: HashMap::from([(DESTINATION_HEADER.to_string(), string_value(destinations))]),
    };
    Struct {
        fields: HashMap::from([(
            LB_NAMESPACE.to_string(),
            Value {
                kind: Some(Kind::StructValue(inner)),
            },
        )]),
    }
}

pub fn headers_response(
    mutation: Option<HeaderMutation>,
    clear_route_cache: bool,
    metadata: Option<Struct>,
) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(processing_response::Response::RequestHeaders(
            HeadersResponse {
                response: Some(CommonResponse {
                    header_mutation: mutation,
                    clear_route_cache,
                    ..Default::default()
                }),
            },
        )),
        dynamic_metadata: metadata,
        ..Default::default()
    }
}

/// BUFFERED: the routing header rides on the body response.
pub fn buffered_body_response(mutation: HeaderMutation, metadata: Struct) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(processing_response::Response::RequestBody(BodyResponse {
            response: Some(CommonResponse {
                header_mutation: Some(mutation),
                clear_route_cache: true,
                ..Default::default()
            }),
        })),
        dynamic_metadata: Some(metadata),
        ..Default::default()
    }
}

/// FULL_DUPLEX_STREAMED: the body goes back as `streamed_response` chunks, eos on the last.
/// An empty body still yields one (empty) chunk: every FDS body reply must carry one.
pub fn streamed_body_chunks(
    body: &[u8],
    end_of_stream: bool,
    response_side: bool,
) -> Vec<ProcessingResponse> {
    let chunks: Vec<&[u8]> = if body.is_empty() {
        vec![&[][..]]
    } else {
        body.chunks(MAX_CHUNK).collect()
    };
    let n = chunks.len();
    chunks
        .into_iter()
        .enumerate()
        .map(|(i, c)| streamed_chunk(c.to_vec(), end_of_stream && i + 1 == n, response_side))
        .collect()
}

pub fn streamed_chunk(
    body: Vec<u8>,
    end_of_stream: bool,
    response_side: bool,
) -> ProcessingResponse {
    let br = BodyResponse {
        response: Some(CommonResponse {
            body_mutation: Some(BodyMutation {
                mutation: Some(body_mutation::Mutation::StreamedResponse(
                    StreamedBodyResponse {
                        body,
                        end_of_stream,
                        ..Default::default()
                    },
                )),
            }),
            ..Default::default()
        }),
    };
    ProcessingResponse {
        response: Some(if response_side {
            processing_response::Response::ResponseBody(br)
        } else {
            processing_response::Response::RequestBody(br)
        }),
        ..Default::default()
    }
}

/// A plain CONTINUE for a body message (non-FDS body modes).
pub fn continue_body(response_side: bool) -> ProcessingResponse {
    let br = BodyResponse {
        response: Some(CommonResponse::default()),
    };
    ProcessingResponse {
        response: Some(if response_side {
            processing_response::Response::ResponseBody(br)
        } else {
            processing_response::Response::RequestBody(br)
        }),
        ..Default::default()
    }
}

pub fn continue_response_headers() -> ProcessingResponse {
    ProcessingResponse {
        response: Some(processing_response::Response::ResponseHeaders(
            HeadersResponse {
                response: Some(CommonResponse::default()),
            },
        )),
        ..Default::default()
    }
}

pub fn trailers_response(response_side: bool) -> ProcessingResponse {
    let tr = TrailersResponse {
        header_mutation: None,
    };
    ProcessingResponse {
        response: Some(if response_side {
            processing_response::Response::ResponseTrailers(tr)
        } else {
            processing_response::Response::RequestTrailers(tr)
        }),
        ..Default::default()
    }
}

pub fn immediate(status: u16, json_body: String, request_id: &str) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(processing_response::Response::ImmediateResponse(
            ImmediateResponse {
                status: Some(HttpStatus {
                    code: i32::from(status),
                }),
                headers: Some(HeaderMutation {
                    set_headers: vec![
                        set_header("content-type", "application/json"),
                        set_header("x-request-id", request_id),
                    ],
                    remove_headers: Vec::new(),
                }),
                body: json_body.into_bytes(),
                details: format!("kvroute_epp_{status}"),
                grpc_status: None,
            },
        )),
        ..Default::default()
    }
}

/// Reads a string or list of strings from `filter_metadata[namespace][key]`.
/// A list yields its strings; a string is split on commas (HeaderToMetadata-style configs).
pub fn metadata_strings(
    md: Option<&envoy_types::pb::envoy::config::core::v3::Metadata>,
    namespace: &str,
    key: &str,
) -> Option<Vec<String>> {
    let v = md?.filter_metadata.get(namespace)?.fields.get(key)?;
    match v.kind.as_ref()? {
        Kind::StringValue(s) => Some(
            s.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(String::from)
                .collect(),
        ),
        Kind::ListValue(l) => Some(
            l.values
                .iter()
                .filter_map(|v| match v.kind.as_ref() {
                    Some(Kind::StringValue(s)) => Some(s.trim().to_string()),
                    _ => None,
                })
                .filter(|s| !s.is_empty())
                .collect(),
        ),
        _ => Some(Vec::new()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::config::core::v3::Metadata;
    use envoy_types::pb::google::protobuf::ListValue;

    #[test]
    fn chunks_are_bounded_and_eos_on_last() {
        let body = vec![7u8; MAX_CHUNK * 2 + 5];
        let chunks = streamed_body_chunks(&body, true, false);
        assert_eq!(chunks.len(), 3);
        let mut total = Vec::new();
        for (i, c) in chunks.iter().enumerate() {
            let Some(processing_response::Response::RequestBody(br)) = &c.response else {
                panic!("body")
            };
            let Some(body_mutation::Mutation::StreamedResponse(s)) = br
                .response
                .as_ref()
                .and_then(|r| r.body_mutation.as_ref())
                .and_then(|m| m.mutation.as_ref())
            else {
                panic!("streamed")
            };
            assert!(s.body.len() <= MAX_CHUNK);
            assert_eq!(s.end_of_stream, i == 2);
            total.extend_from_slice(&s.body);
        }
        assert_eq!(total, body);
        assert_eq!(
            streamed_body_chunks(&[], true, false).len(),
            1,
            "empty body still answered"
        );
    }

    #[test]
    fn subset_hint_forms() {
        let list = Value {
            kind: Some(Kind::ListValue(ListValue {
                values: vec![string_value("10.0.0.1:8000"), string_value(" 10.0.0.2 ")],
            })),
        };
        let mk = |v: Value| Metadata {
            filter_metadata: HashMap::from([(
                SUBSET_NAMESPACE.to_string(),
                Struct {
                    fields: HashMap::from([(SUBSET_KEY.to_string(), v)]),
                },
            )]),
            ..Default::default()
        };
        let md = mk(list);
        assert_eq!(
            metadata_strings(Some(&md), SUBSET_NAMESPACE, SUBSET_KEY),
            Some(vec!["10.0.0.1:8000".to_string(), "10.0.0.2".to_string()])
        );
        let md = mk(string_value("a:1, b:2"));
        assert_eq!(
            metadata_strings(Some(&md), SUBSET_NAMESPACE, SUBSET_KEY),
            Some(vec!["a:1".into(), "b:2".into()])
        );
        let md = mk(string_value(""));
        assert_eq!(
            metadata_strings(Some(&md), SUBSET_NAMESPACE, SUBSET_KEY),
            Some(vec![])
        );
        assert_eq!(metadata_strings(None, SUBSET_NAMESPACE, SUBSET_KEY), None);
    }
}
