//! libvirt's client library, loaded at run time (dlopen) on the first query, and the
//! handful of its calls the agent makes: open a connection, list every domain, read a
//! domain's UUID, name, state and XML, and subscribe to domain events (run by libvirt's
//! default event loop on a thread of its own).
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
/// `VIR_ERR_NO_SUPPORT`: the driver does not implement the call (events, here).
pub const ERR_NO_SUPPORT: i32 = 3;
/// `VIR_UUID_STRING_BUFLEN`.
const UUID_STRING_BUFLEN: usize = 37;
/// `VIR_DOMAIN_EVENT_ID_LIFECYCLE`: defined, undefined, started, stopped...
const EVENT_ID_LIFECYCLE: c_int = 0;
/// `VIR_DOMAIN_EVENT_ID_DEVICE_REMOVED`: a device left a running domain (live detach).
const EVENT_ID_DEVICE_REMOVED: c_int = 15;
/// `VIR_DOMAIN_EVENT_ID_DEVICE_ADDED`: a device joined a running domain (live attach).
const EVENT_ID_DEVICE_ADDED: c_int = 19;

type Ptr = *mut c_void;
type ErrorFunc = unsafe extern "C" fn(user: Ptr, error: Ptr);
/// `virFreeCallback`.
type FreeFunc = unsafe extern "C" fn(opaque: Ptr);
/// `virConnectDomainEventGenericCallback`: the type every event callback is registered as
/// (libvirt calls each with the arguments of its own event's type).
type GenericFunc = unsafe extern "C" fn(conn: Ptr, dom: Ptr, opaque: Ptr);
/// `virConnectDomainEventCallback` (the lifecycle event's).
type LifecycleFunc =
    unsafe extern "C" fn(conn: Ptr, dom: Ptr, event: c_int, detail: c_int, opaque: Ptr) -> c_int;
/// `virConnectDomainEventDeviceAddedCallback` and `...DeviceRemovedCallback`.
type DeviceFunc =
    unsafe extern "C" fn(conn: Ptr, dom: Ptr, alias: *const c_char, opaque: Ptr) -> c_int;
/// `virConnectCloseFunc`.
type CloseFunc = unsafe extern "C" fn(conn: Ptr, reason: c_int, opaque: Ptr);

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
    connect_is_alive: unsafe extern "C" fn(Ptr) -> c_int,
    event_register_default_impl: unsafe extern "C" fn() -> c_int,
    event_run_default_impl: unsafe extern "C" fn() -> c_int,
    event_register_any:
        unsafe extern "C" fn(Ptr, Ptr, c_int, GenericFunc, Ptr, Option<FreeFunc>) -> c_int,
    event_deregister_any: unsafe extern "C" fn(Ptr, c_int) -> c_int,
    register_close: unsafe extern "C" fn(Ptr, CloseFunc, Ptr, Option<FreeFunc>) -> c_int,
    unregister_close: unsafe extern "C" fn(Ptr, CloseFunc) -> c_int,
    /// Whether the event loop's thread is running (started with the library).
    events: Result<(), String>,
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

/// The library as the process uses it: loaded, its errors silenced, and its default event
/// loop registered and running before the first connection opens.
fn load() -> Result<Api, String> {
    let mut api = load_from(LIBRARY)?;
    api.events = start_event_loop(&api);
    Ok(api)
}

/// Registers libvirt's default event loop and runs it on a thread of its own, for the
/// life of the process. It has to exist before a connection opens (one opened without it
/// never delivers events), and once it exists it has to run: a remote connection then
/// also sends keepalives, answered through it. Only [`load`] calls this, for the one
/// `Api` that lives in a static, so the library outlives the thread.
fn start_event_loop(api: &Api) -> Result<(), String> {
    // SAFETY: libvirt's own event loop, registered once, before any connection exists.
    if unsafe { (api.event_register_default_impl)() } < 0 {
        return Err("libvirt's default event loop could not be registered".into());
    }
    let run = api.event_run_default_impl;
    std::thread::Builder::new()
        .name("hostdevd-libvirt-events".into())
        .spawn(move || loop {
            // SAFETY: one iteration of the loop registered above; only this thread runs
            // it, and the library stays loaded for the life of the process.
            if unsafe { run() } < 0 {
                // Not expected; never spin if it happens.
                std::thread::sleep(std::time::Duration::from_secs(1));
            }
        })
        .map(drop)
        .map_err(|e| format!("libvirt's event loop thread could not start: {e}"))
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
        connect_is_alive: sym!("virConnectIsAlive"),
        event_register_default_impl: sym!("virEventRegisterDefaultImpl"),
        event_run_default_impl: sym!("virEventRunDefaultImpl"),
        event_register_any: sym!("virConnectDomainEventRegisterAny"),
        event_deregister_any: sym!("virConnectDomainEventDeregisterAny"),
        register_close: sym!("virConnectRegisterCloseCallback"),
        unregister_close: sym!("virConnectUnregisterCloseCallback"),
        events: Err("not started".into()),
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

/// What an event subscription calls: it only wakes someone up (the poller), on
/// libvirt's event loop thread, so it must not block.
pub type Nudge = std::sync::Arc<dyn Fn() + Send + Sync>;

/// A subscription to every domain's lifecycle events (defined, undefined, started,
/// stopped...), live device attach and detach, and the connection's close, on a
/// connection of its own; each calls the [`Nudge`]. Dropping it unsubscribes and closes.
pub struct EventWatch {
    conn: Connection,
    ids: Vec<c_int>,
    close_registered: bool,
}

impl std::fmt::Debug for EventWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventWatch")
            .field("ids", &self.ids)
            .finish()
    }
}

/// Calls the nudge behind `opaque`; a panic stops here, never unwinds into libvirt.
///
/// SAFETY: `opaque` is a `Box<Nudge>` leaked by [`EventWatch::subscribe`] and not yet
/// freed (libvirt frees it through [`free_nudge`] only once the callback is gone).
unsafe fn nudge(opaque: Ptr) {
    // SAFETY: as the caller promises.
    let f = unsafe { &*(opaque as *const Nudge) };
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f()));
}

unsafe extern "C" fn on_lifecycle(_: Ptr, _: Ptr, _: c_int, _: c_int, opaque: Ptr) -> c_int {
    // SAFETY: registered with a leaked Box<Nudge> as its opaque.
    unsafe { nudge(opaque) };
    0
}

unsafe extern "C" fn on_device(_: Ptr, _: Ptr, _: *const c_char, opaque: Ptr) -> c_int {
    // SAFETY: as above.
    unsafe { nudge(opaque) };
    0
}

unsafe extern "C" fn on_close(_: Ptr, _: c_int, opaque: Ptr) {
    // SAFETY: as above.
    unsafe { nudge(opaque) };
}

/// libvirt's free callback for a nudge: called once, when its callback is removed.
unsafe extern "C" fn free_nudge(opaque: Ptr) {
    // SAFETY: the Box leaked for this registration, freed only here, once.
    drop(unsafe { Box::from_raw(opaque as *mut Nudge) });
}

impl EventWatch {
    /// Opens a connection to `uri` and subscribes. Fails with libvirt's error (code
    /// [`ERR_NO_SUPPORT`] where the driver has no events), or when the event loop did
    /// not start with the library.
    pub fn subscribe(uri: &str, on_event: Nudge) -> Result<EventWatch, Error> {
        let api = api()?;
        api.events
            .clone()
            .map_err(|message| Error { code: 0, message })?;
        let conn = Connection::open(uri)?;
        let mut watch = EventWatch {
            conn,
            ids: Vec::new(),
            close_registered: false,
        };
        // SAFETY: `virConnectDomainEventGenericCallback` is how libvirt takes every event
        // callback; it calls each with its own event's arguments, which these match
        // (libvirt's VIR_DOMAIN_EVENT_CALLBACK cast does the same).
        let lifecycle = unsafe { std::mem::transmute::<LifecycleFunc, GenericFunc>(on_lifecycle) };
        // SAFETY: as above, for the device added and removed events.
        let device = unsafe { std::mem::transmute::<DeviceFunc, GenericFunc>(on_device) };
        let events = [
            (EVENT_ID_LIFECYCLE, lifecycle),
            (EVENT_ID_DEVICE_ADDED, device),
            (EVENT_ID_DEVICE_REMOVED, device),
        ];
        for (id, cb) in events {
            let opaque = Box::into_raw(Box::new(on_event.clone())).cast::<c_void>();
            // SAFETY: a live connection, no domain filter, a callback of the event's
            // type; libvirt owns `opaque` from here and frees it with `free_nudge`.
            let rc = unsafe {
                (api.event_register_any)(
                    watch.conn.ptr.as_ptr(),
                    std::ptr::null_mut(),
                    id,
                    cb,
                    opaque,
                    Some(free_nudge),
                )
            };
            if rc < 0 {
                // Whether libvirt freed `opaque` on failure is not documented: leak it
                // (one pointer) rather than risk a double free. Dropping `watch`
                // removes the subscriptions already made.
                return Err(last_error(api));
            }
            watch.ids.push(rc);
        }
        let opaque = Box::into_raw(Box::new(on_event)).cast::<c_void>();
        // SAFETY: as above, for the connection's close callback.
        let rc = unsafe {
            (api.register_close)(watch.conn.ptr.as_ptr(), on_close, opaque, Some(free_nudge))
        };
        if rc < 0 {
            return Err(last_error(api));
        }
        watch.close_registered = true;
        Ok(watch)
    }

    /// Whether the connection still works (`virConnectIsAlive`): false once the daemon at
    /// the other end went away, when the subscription must be made again.
    pub fn is_alive(&self) -> bool {
        // SAFETY: a live connection reference.
        unsafe { (self.conn.api.connect_is_alive)(self.conn.ptr.as_ptr()) == 1 }
    }
}

impl Drop for EventWatch {
    fn drop(&mut self) {
        let api = self.conn.api;
        for id in self.ids.drain(..) {
            // SAFETY: an id this connection returned, removed once; libvirt then frees its
            // nudge. A failure (the connection is dead) leaves that to the close below.
            unsafe { (api.event_deregister_any)(self.conn.ptr.as_ptr(), id) };
        }
        if self.close_registered {
            // SAFETY: the callback registered on this connection, removed once.
            unsafe { (api.unregister_close)(self.conn.ptr.as_ptr(), on_close) };
        }
        // SAFETY: the calls above may have failed on a dead connection; clear the
        // thread's error slot so it does not leak into the next call's report.
        unsafe { (api.reset_last_error)() };
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

    /// The in-process test driver's default host is one per process: the tests that
    /// define domains on it or count them take turns.
    static DEFAULT_HOST: std::sync::Mutex<()> = std::sync::Mutex::new(());

    fn default_host() -> std::sync::MutexGuard<'static, ()> {
        DEFAULT_HOST.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Through the real library and its in-process test driver: the default host has one
    /// running domain named "test".
    #[test]
    fn lists_the_test_drivers_default_domain() {
        let _host = default_host();
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

    /// Through the real library's event loop: defining, starting and stopping a domain on
    /// another connection each nudge the subscriber; once it is dropped, undefining the
    /// domain does not.
    #[test]
    fn domain_events_nudge_the_subscriber() {
        let _host = default_host();
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let watch = EventWatch::subscribe(
            "test:///default",
            std::sync::Arc::new(move || {
                let _ = tx.send(());
            }),
        )
        .expect("the test driver has events");
        assert!(watch.is_alive());
        let other = virt::connect::Connect::open(Some("test:///default")).expect("test driver");
        let xml = "<domain type='test'><name>ffi-events</name><memory>1024</memory>\
                   <os><type>hvm</type></os></domain>";
        let expect_nudge = |what: &str| {
            rx.recv_timeout(std::time::Duration::from_secs(20))
                .unwrap_or_else(|e| panic!("no event after {what}: {e}"));
            while rx.try_recv().is_ok() {}
        };
        while rx.try_recv().is_ok() {}
        let dom = other.define_domain_xml(xml).expect("define");
        expect_nudge("define");
        dom.create().expect("start");
        expect_nudge("start");
        dom.destroy().expect("stop");
        expect_nudge("stop");
        drop(watch);
        while rx.try_recv().is_ok() {}
        dom.undefine().expect("undefine");
        // Events arrive on the loop's thread a little after the call that caused them:
        // give a wrongly delivered one the time to show.
        std::thread::sleep(std::time::Duration::from_millis(300));
        assert!(
            rx.try_recv().is_err(),
            "a dropped subscription was still nudged"
        );
    }

    #[test]
    fn a_nul_in_the_uri_is_refused_before_libvirt() {
        let e = Connection::open("test:///de\0fault").expect_err("NUL");
        assert_eq!(e.code, 0);
        assert!(e.message.contains("NUL"), "{e}");
    }
}
