//! The protobuf codec of the HostDev service: prost's, except that a request that cannot
//! be decoded (non-UTF-8 strings, bad varints, wrong wire types, nesting past prost's
//! limit) is INVALID_ARGUMENT, through the service's one error map, not tonic's INTERNAL:
//! it is the caller's bad input, and an INTERNAL would invite a blind retry. Its buffers
//! start small (see `BUFFER_BYTES`).

use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder};
use tonic::Status;
use tonic_prost::{ProstCodec, ProstDecoder, ProstEncoder};

use super::status::{to_status, ApiError};

/// The size each call's encode and decode buffer starts at (tonic's default is 8 KiB). A
/// claim's or release's messages take a few hundred bytes, and glibc serves a request of
/// at most 1,032 bytes from the thread's own cache; a larger one takes the allocator's
/// shared lock (one arena, see `memory`), which every call took twice under load. A
/// larger message grows its buffer as it needs.
const BUFFER_BYTES: usize = 1000;
/// How much a server stream (Watch) gathers before it yields: tonic's default.
const YIELD_BYTES: usize = 32 << 10;

/// The buffer settings of every encoder and decoder of the service.
fn buffers() -> BufferSettings {
    BufferSettings::new(BUFFER_BYTES, YIELD_BYTES)
}

/// [`ProstCodec`] with decode errors mapped by [`to_status`] and smaller buffers.
#[derive(Debug, Clone, Default)]
pub struct HostDevCodec<T, U>(ProstCodec<T, U>);

impl<T, U> Codec for HostDevCodec<T, U>
where
    T: prost::Message + Send + 'static,
    U: prost::Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = HostDevDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstCodec::<T, U>::raw_encoder(buffers())
    }

    fn decoder(&mut self) -> Self::Decoder {
        HostDevDecoder(ProstCodec::<T, U>::raw_decoder(buffers()))
    }
}

/// Decodes with prost; a failure names the message and field that could not be read.
#[derive(Debug, Clone)]
pub struct HostDevDecoder<U>(ProstDecoder<U>);

impl<U: prost::Message + Default> Decoder for HostDevDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        U::decode(buf)
            .map(Some)
            .map_err(|e| to_status(&ApiError::Malformed(e)))
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.0.buffer_settings()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Code;

    #[test]
    fn a_decode_error_is_invalid_argument_naming_the_field() {
        // GetDeviceRequest.address (field 1, length-delimited) holding 0xff: not UTF-8.
        let bytes: &[u8] = &[0x0a, 0x01, 0xff];
        let e = <crate::api::proto::GetDeviceRequest as prost::Message>::decode(bytes)
            .expect_err("not UTF-8");
        let s = to_status(&ApiError::Malformed(e));
        assert_eq!(s.code(), Code::InvalidArgument);
        assert!(
            s.message().contains("GetDeviceRequest.address"),
            "{}",
            s.message()
        );
    }
}
