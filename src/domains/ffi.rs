//! libvirt's client library, loaded at run time (dlopen) on the first query, and the
//! handful of its calls the agent makes: open a connection, list every domain, read a
//! domain's UUID, name, state and XML.
//!
//! Why not link it: libvirt.so.0 pulls in 56 more shared libraries (glib, gnutls, curl,
//! krb5, ICU…). Linked, every process of this package paid for them at start, libvirt
//! enabled or not: 20 ms of dynamic loading before `main` and about 20 MiB of mapped,
//! resident pages, with `hostdevctl` and `hostdevd scan` never calling libvirt at all.
//! Loaded here only when `[libvirt] enabled` and a query runs, the rest of the agent
//! starts and lives without them, and an agent with libvirt disabled runs on a host
//! without libvirt installed. The ABI used is libvirt's stable public C API, every call
//! present since libvirt 4.5 (2018).

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::ptr::NonNull;
use std::sync::OnceLock;

/// The library's name as the runtime package (libvirt0, libvirt-libs) installs it.
pub const LIBRARY: &str = "libvirt.so.0";

/// `VIR_ERR_NO_DOMAIN`: the domain is gone.
pub const ERR_NO_DOMAIN: i32 = 42;
/// `VIR_DOMAIN_XML_INACTIVE`: the persistent definition rather than the live one.
pub const XML_INACTIVE: u32 = 2;
/// `VIR_UUID_STRING_BUFLEN`.
const UUID_STRING_BUFLEN: usize = 37;

type Ptr = *mut c_void;
type ErrorFunc = unsafe extern "C" fn(user: Ptr, error: Ptr);

/// The entry points, resolved once. The library stays loaded for the life of the process.
struct Api {
    _lib: libloading::Library,
    connect_open: unsafe extern "C" fn(*const c_char) -> Ptr,
    connect_close: unsafe extern "C" fn(Ptr) -> c_int,
    list_all_domains: unsafe extern "C" fn(Ptr, *mut *mut Ptr, c_uint) -> c_int,
    domain_free: unsafe extern "C" fn(Ptr) -> c_int,
    domain_uuid_string: unsafe extern "C" fn(Ptr, *mut c_char) -> c_int,
    domain_name: unsafe extern "C" fn(Ptr) -> *const c_char,
    domain_is_active: unsafe extern "C" fn(Ptr) -> c_int,
    domain_xml_desc: unsafe extern "C" fn(Ptr, c_uint) -> *mut c_char,
    last_error_code: unsafe extern "C" fn() -> c_int,
    last_error_message: unsafe extern "C" fn() -> *const c_char,
    reset_last_error: unsafe extern "C" fn(),
}

/// A failed libvirt call: its error code and message, as libvirt reported them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    /// libvirt's `virErrorNumber`, or 0 when the library itself could not be loaded.
    pub code: i32,
    pub message: String,
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (libvirt error {})", self.message, self.code)
    }
}

impl std::error::Error for Error {}

/// libvirt's default error handler prints every error on stderr; this one drops them,
/// since every failure is returned (and logged) through [`Error`].
unsafe extern "C" fn ignore_error(_user: Ptr, _error: Ptr) {}

fn load() -> Result<Api, String> {
    load_from(LIBRARY)
}

fn load_from(library: &str) -> Result<Api, String> {
    // SAFETY: loading libvirt runs its constructors, which only initialise the library.
    let lib = unsafe { libloading::Library::new(library) }.map_err(|e| {
        format!(
            "libvirt's client library {library} cannot be loaded ({e}); install libvirt0 \
             (Debian, Ubuntu) or libvirt-libs (RPM), or set [libvirt] enabled = false"
        )
    })?;
    macro_rules! sym {
        ($name:literal) => {
            // SAFETY: the type written at each use is the C prototype from libvirt's
            // public headers for that symbol.
            *unsafe { lib.get(concat!($name, "\0").as_bytes()) }.map_err(|e| {
                format!(
                    "{LIBRARY} has no {} ({e}); libvirt 4.5 or later is needed",
                    $name
                )
            })?
        };
    }
    let set_error_func: unsafe extern "C" fn(Ptr, Option<ErrorFunc>) = sym!("virSetErrorFunc");
    // SAFETY: sets the process-wide default handler before any connection exists.
    unsafe { set_error_func(std::ptr::null_mut(), Some(ignore_error)) };
    Ok(Api {
        connect_open: sym!("virConnectOpen"),
        connect_close: sym!("virConnectClose"),
        list_all_domains: sym!("virConnectListAllDomains"),
        domain_free: sym!("virDomainFree"),
        domain_uuid_string: sym!("virDomainGetUUIDString"),
        domain_name: sym!("virDomainGetName"),
        domain_is_active: sym!("virDomainIsActive"),
        domain_xml_desc: sym!("virDomainGetXMLDesc"),
        last_error_code: sym!("virGetLastErrorCode"),
        last_error_message: sym!("virGetLastErrorMessage"),
        reset_last_error: sym!("virResetLastError"),
        _lib: lib,
    })
}

fn api() -> Result<&'static Api, Error> {
    static API: OnceLock<Result<Api, String>> = OnceLock::new();
    API.get_or_init(load).as_ref().map_err(|message| Error {
        code: 0,
        message: message.clone(),
    })
}

/// The calling thread's last libvirt error (libvirt keeps it per thread), then cleared.
fn last_error(api: &Api) -> Error {
    // SAFETY: both read the calling thread's error slot; the message pointer is valid
    // until the next libvirt call on this thread, and is copied before that.
    let (code, message) = unsafe {
        let code = (api.last_error_code)();
        let m = (api.last_error_message)();
        let message = if m.is_null() {
            "unknown libvirt error".to_string()
        } else {
            CStr::from_ptr(m).to_string_lossy().into_owned()
        };
        (api.reset_last_error)();
        (code, message)
    };
    Error { code, message }
}

/// Copies and frees a string libvirt allocated for the caller.
///
/// SAFETY: `p` is null or a NUL-terminated string from libvirt's allocator (malloc).
unsafe fn take_string(p: *mut c_char) -> Option<String> {
    if p.is_null() {
        return None;
    }
    // SAFETY: as the caller promises; the string is copied before it is freed, once.
    let s = unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned();
    // SAFETY: as above.
    unsafe { libc::free(p.cast()) };
    Some(s)
}

/// An open connection (`virConnectPtr`), closed on drop.
#[derive(Debug)]
pub struct Connection {
    ptr: NonNull<c_void>,
    api: &'static Api,
}

// SAFETY: libvirt's connection objects are thread-safe (reference counted and locked
// inside the library); the agent uses one from whichever blocking thread queries.
unsafe impl Send for Connection {}
// SAFETY: as above; every call through `&Connection` is one of libvirt's thread-safe
// public entry points.
unsafe impl Sync for Connection {}

impl std::fmt::Debug for Api {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(LIBRARY)
    }
}

impl Connection {
    /// `virConnectOpen(uri)`: read-write, since the test driver and the session daemon
    /// refuse nothing to a read-only client that the agent needs, and read-only would
    /// need its own socket permissions on a real host.
    pub fn open(uri: &str) -> Result<Connection, Error> {
        let api = api()?;
        let c_uri = CString::new(uri).map_err(|_| Error {
            code: 0,
            message: "a libvirt URI cannot contain a NUL byte".into(),
        })?;
        // SAFETY: a valid C string; the result is null or a connection we now own.
        let ptr = unsafe { (api.connect_open)(c_uri.as_ptr()) };
        match NonNull::new(ptr) {
            Some(ptr) => Ok(Connection { ptr, api }),
            None => Err(last_error(api)),
        }
    }

    /// `virConnectListAllDomains(flags)`: every domain the connection sees.
    pub fn list_all_domains(&self, flags: u32) -> Result<Vec<Domain>, Error> {
        let api = self.api;
        let mut array: *mut Ptr = std::ptr::null_mut();
        // SAFETY: on success libvirt stores an array of `n` domain references we own.
        let n = unsafe { (api.list_all_domains)(self.ptr.as_ptr(), &mut array, flags) };
        if n < 0 {
            return Err(last_error(api));
        }
        let mut out = Vec::with_capacity(n as usize);
        if !array.is_null() {
            for i in 0..n as usize {
                // SAFETY: `i < n`, within the array libvirt returned.
                let d = unsafe { *array.add(i) };
                if let Some(ptr) = NonNull::new(d) {
                    out.push(Domain { ptr, api });
                }
            }
            // SAFETY: the array (not its elements, now owned by `out`) is the caller's to
            // free with free(), as libvirt documents.
            unsafe { libc::free(array.cast()) };
        }
        Ok(out)
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        // SAFETY: we own this reference and drop it once.
        unsafe { (self.api.connect_close)(self.ptr.as_ptr()) };
    }
}

/// A domain reference (`virDomainPtr`), freed on drop.
#[derive(Debug)]
pub struct Domain {
    ptr: NonNull<c_void>,
    api: &'static Api,
}

impl Domain {
    pub fn uuid(&self) -> Result<uuid::Uuid, Error> {
        let mut buf = [0 as c_char; UUID_STRING_BUFLEN];
        // SAFETY: the buffer has the length libvirt's prototype requires.
        let rc = unsafe { (self.api.domain_uuid_string)(self.ptr.as_ptr(), buf.as_mut_ptr()) };
        if rc < 0 {
            return Err(last_error(self.api));
        }
        // SAFETY: on success libvirt wrote a NUL-terminated string into the buffer.
        let s = unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy();
        uuid::Uuid::parse_str(&s).map_err(|e| Error {
            code: 0,
            message: format!("libvirt returned a malformed domain UUID {s:?}: {e}"),
        })
    }

    pub fn name(&self) -> Result<String, Error> {
        // SAFETY: the name belongs to the domain object and lives as long as it; copied.
        let p = unsafe { (self.api.domain_name)(self.ptr.as_ptr()) };
        if p.is_null() {
            return Err(last_error(self.api));
        }
        // SAFETY: non-null, NUL-terminated, owned by the live domain object.
        Ok(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
    }

    pub fn is_active(&self) -> Result<bool, Error> {
        // SAFETY: a live domain reference.
        match unsafe { (self.api.domain_is_active)(self.ptr.as_ptr()) } {
            rc if rc < 0 => Err(last_error(self.api)),
            rc => Ok(rc > 0),
        }
    }

    pub fn xml_desc(&self, flags: u32) -> Result<String, Error> {
        // SAFETY: a live domain reference; the result is null or a string we now own.
        let p = unsafe { (self.api.domain_xml_desc)(self.ptr.as_ptr(), flags) };
        // SAFETY: null or libvirt's malloc'd string.
        unsafe { take_string(p) }.ok_or_else(|| last_error(self.api))
    }
}

impl Drop for Domain {
    fn drop(&mut self) {
        // SAFETY: we own this reference and drop it once.
        unsafe { (self.api.domain_free)(self.ptr.as_ptr()) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Through the real library and its in-process test driver: the default host has one
    /// running domain named "test".
    #[test]
    fn lists_the_test_drivers_default_domain() {
        let c = Connection::open("test:///default").expect("libvirt0 and its test driver");
        let doms = c.list_all_domains(0).expect("list");
        assert_eq!(doms.len(), 1);
        let d = &doms[0];
        assert_eq!(d.name().expect("name"), "test");
        assert!(d.is_active().expect("state"));
        assert!(!d.uuid().expect("uuid").is_nil());
        let xml = d.xml_desc(0).expect("live xml");
        assert!(xml.starts_with("<domain"), "{xml}");
        assert!(d
            .xml_desc(XML_INACTIVE)
            .expect("persistent xml")
            .contains("<name>test</name>"));
    }

    /// A failed call returns libvirt's own code and message, and the next call on the
    /// thread does not see that error again.
    #[test]
    fn a_failed_open_carries_libvirts_error() {
        let e = Connection::open("test:///nonexistent/host.xml").expect_err("no such host file");
        assert_ne!(e.code, 0, "{e}");
        assert!(e.message.contains("nonexistent"), "{e}");
        let again = Connection::open("test:///default");
        assert!(again.is_ok());
    }

    /// Without the library, the error says what to install or to turn libvirt off.
    #[test]
    fn a_missing_library_says_what_to_install() {
        let e = load_from("libvirt-not-installed.so.0").expect_err("no such library");
        assert!(
            e.contains("libvirt-not-installed.so.0 cannot be loaded"),
            "{e}"
        );
        assert!(e.contains("install libvirt0"), "{e}");
        assert!(e.contains("enabled = false"), "{e}");
    }

    /// A library without libvirt's entry points is refused by name, not called.
    #[test]
    fn a_library_without_the_entry_points_is_refused() {
        let e = load_from("libc.so.6").expect_err("libc is not libvirt");
        assert!(e.contains("has no virSetErrorFunc"), "{e}");
    }

    #[test]
    fn a_nul_in_the_uri_is_refused_before_libvirt() {
        let e = Connection::open("test:///de\0fault").expect_err("NUL");
        assert_eq!(e.code, 0);
        assert!(e.message.contains("NUL"), "{e}");
    }
}
