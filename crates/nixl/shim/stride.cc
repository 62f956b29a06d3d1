// kvbridge-nixl's stride shim: prepares NIXL stride descriptor lists (NIXL >= 1.5), which
// NIXL's C API (libnixl_capi.so, what nixl-sys wraps) does not offer.
//
// The NIXL runtime ships no C++ headers, so nothing here includes NIXL's. The shim declares
// the few types it names itself, and reaches NIXL's C++ entry points by their exported
// (mangled) symbol names at run time, with dlsym on the libraries libnixl_capi.so already
// loaded: nothing links against NIXL, so the shim builds wherever a C++ compiler is, and a
// runtime without the stride API is reported (kvb_stride_resolve) instead of failing to load.
//
// What the shim relies on, each checked by the crate's tests against the runtime
// (`crates/nixl/src/stride.rs`):
// - a stride descriptor is five 8-byte words: addr, len, devId, stride, count (the list's
//   `to_string` names them back);
// - a descriptor list object is at most 40 bytes (vtable pointer, memory type, std::vector):
//   the shim reserves 128 and checks the constructor and destructor touch only the first 40;
// - the Itanium C++ ABI: a non-virtual member function is a function taking `this` first,
//   references are pointers, and an enum status is returned as an int;
// - nixl-sys's C API handles: an agent handle starts with its `nixlAgent*`, and a descriptor
//   list handle is a struct holding one `nixlDlistH*`, freed by the C API with `delete`.

#include <dlfcn.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <new>
#include <string>

namespace {

// The symbols, as `nm -D` lists them in libnixl_build.so and libnixl.so of NIXL 1.5.
const char *const kListCtor = "_ZN12nixlDescListI14nixlStrideDescEC1ERK10nixl_mem_tRKi";
const char *const kListDtor = "_ZN12nixlDescListI14nixlStrideDescED1Ev";
const char *const kListAdd = "_ZN12nixlDescListI14nixlStrideDescE7addDescERKS0_";
const char *const kListReserve = "_ZN12nixlDescListI14nixlStrideDescE7reserveEm";
const char *const kListCount = "_ZNK12nixlDescListI14nixlStrideDescE9descCountEv";
const char *const kListToString = "_ZNK12nixlDescListI14nixlStrideDescE9to_stringB5cxx11Eb";
const char *const kPrepLocal =
    "_ZNK9nixlAgent13prepXferDlistERK12nixlDescListI14nixlStrideDescERP10nixlDlistHPK21"
    "nixlAgentOptionalArgs";
const char *const kPrepRemote =
    "_ZNK9nixlAgent13prepXferDlistERKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEERK12"
    "nixlDescListI14nixlStrideDescERP10nixlDlistHPK21nixlAgentOptionalArgs";

// Status codes of the shim itself, below NIXL's own (which go down to about -12).
const int kNotResolved = -1000;
const int kException = -1001;
const int kBadArgument = -1002;

// The bytes reserved for one list object, and the most the runtime's may use.
const size_t kListReserved = 128;
const size_t kListMax = 40;

struct StrideDesc {
    uintptr_t addr;
    size_t len;
    uint64_t dev_id;
    size_t stride;
    size_t count;
};

using ListCtor = void (*)(void *self, const int *mem_type, const int *init_size);
using ListDtor = void (*)(void *self);
using ListAdd = void (*)(void *self, const StrideDesc *desc);
using ListReserve = void (*)(void *self, size_t n);
using ListCount = int (*)(const void *self);
using ListToString = void (*)(std::string *out, const void *self, bool compact);
using PrepLocal = int (*)(const void *agent, const void *list, void **handle, const void *args);
using PrepRemote = int (*)(const void *agent,
                           const std::string *remote,
                           const void *list,
                           void **handle,
                           const void *args);

struct Api {
    ListCtor ctor = nullptr;
    ListDtor dtor = nullptr;
    ListAdd add = nullptr;
    ListReserve reserve = nullptr;
    ListCount count = nullptr;
    ListToString to_string = nullptr;
    PrepLocal prep_local = nullptr;
    PrepRemote prep_remote = nullptr;
    bool ok = false;
    char missing[512] = {0};
};

// nixl-sys's descriptor list handle (nixl_capi_xfer_dlist_handle_s): one nixlDlistH*.
struct CapiDlistHandle {
    void *handle;
};

void *
find(const char *name, char *missing, size_t cap) {
    // libnixl_capi.so, loaded before any call here, brings both libraries in.
    const char *libs[] = {"libnixl_build.so", "libnixl.so"};
    for (const char *lib : libs) {
        void *h = dlopen(lib, RTLD_NOW | RTLD_NOLOAD);
        if (h == nullptr) continue;
        void *sym = dlsym(h, name);
        dlclose(h); // drops only the reference NOLOAD took
        if (sym != nullptr) return sym;
    }
    if (missing[0] == '\0') {
        std::snprintf(missing,
                      cap,
                      "%s (looked in libnixl_build.so and libnixl.so as loaded)",
                      name);
    }
    return nullptr;
}

const Api &
api() {
    static Api a = [] {
        Api a;
        a.ctor = reinterpret_cast<ListCtor>(find(kListCtor, a.missing, sizeof a.missing));
        a.dtor = reinterpret_cast<ListDtor>(find(kListDtor, a.missing, sizeof a.missing));
        a.add = reinterpret_cast<ListAdd>(find(kListAdd, a.missing, sizeof a.missing));
        a.reserve = reinterpret_cast<ListReserve>(find(kListReserve, a.missing, sizeof a.missing));
        a.count = reinterpret_cast<ListCount>(find(kListCount, a.missing, sizeof a.missing));
        a.to_string =
            reinterpret_cast<ListToString>(find(kListToString, a.missing, sizeof a.missing));
        a.prep_local = reinterpret_cast<PrepLocal>(find(kPrepLocal, a.missing, sizeof a.missing));
        a.prep_remote =
            reinterpret_cast<PrepRemote>(find(kPrepRemote, a.missing, sizeof a.missing));
        a.ok = a.ctor && a.dtor && a.add && a.reserve && a.count && a.to_string && a.prep_local &&
            a.prep_remote;
        return a;
    }();
    return a;
}

// One stride list in reserved storage, destroyed with the scope.
class List {
public:
    List(const Api &a, int mem_type) : api_(a) {
        int init = 0;
        api_.ctor(bytes_, &mem_type, &init);
    }

    ~List() {
        api_.dtor(bytes_);
    }

    List(const List &) = delete;
    List &
    operator=(const List &) = delete;

    void *
    get() {
        return bytes_;
    }

private:
    const Api &api_;
    alignas(16) unsigned char bytes_[kListReserved];
};

void
fill(const Api &a, List &list, const uint64_t *runs, size_t n) {
    a.reserve(list.get(), n);
    for (size_t i = 0; i < n; i++) {
        const uint64_t *r = runs + 5 * i;
        StrideDesc d{static_cast<uintptr_t>(r[0]),
                     static_cast<size_t>(r[1]),
                     r[2],
                     static_cast<size_t>(r[3]),
                     static_cast<size_t>(r[4])};
        a.add(list.get(), &d);
    }
}

} // namespace

extern "C" {

// 1 when every symbol the shim needs is in the loaded runtime, else 0 with the first missing
// one written to `missing` (NUL-terminated, cut to `cap` bytes).
int
kvb_stride_resolve(char *missing, size_t cap) {
    const Api &a = api();
    if (!a.ok && cap > 0) {
        std::snprintf(missing, cap, "%s", a.missing);
    }
    return a.ok ? 1 : 0;
}

// Prepares a stride list of `n` runs (5 words each: addr, len, devId, stride, count) of
// memory type `mem_type` with the agent behind nixl-sys's agent handle `capi_agent`: local
// when `remote` is NULL, else against the remote agent of that name. On success (0) `*out`
// holds a new nixl-sys descriptor list handle (released with
// nixl_capi_release_xfer_dlist_handle). Otherwise NIXL's status, or one of the shim's own.
int
kvb_stride_prep(void *capi_agent,
                const char *remote,
                int mem_type,
                const uint64_t *runs,
                size_t n,
                void **out) {
    const Api &a = api();
    if (!a.ok) return kNotResolved;
    if (capi_agent == nullptr || out == nullptr || (runs == nullptr && n > 0)) {
        return kBadArgument;
    }
    const void *agent = *static_cast<void *const *>(capi_agent);
    if (agent == nullptr) return kBadArgument;
    try {
        List list(a, mem_type);
        fill(a, list, runs, n);
        void *dlist = nullptr;
        int status;
        if (remote == nullptr) {
            status = a.prep_local(agent, list.get(), &dlist, nullptr);
        } else {
            std::string name(remote);
            status = a.prep_remote(agent, &name, list.get(), &dlist, nullptr);
        }
        if (status != 0) return status;
        *out = new CapiDlistHandle{dlist};
        return 0;
    }
    catch (...) {
        return kException;
    }
}

// The layout checks: builds a list of `n` runs in storage filled with 0x5a and writes the
// list's own description (its `to_string`) to `text`; `*count` is the list's descriptor
// count and `*touched` one past the last byte of the reserved storage the list's
// constructor, adds and destructor changed. Returns the description's length, or a status.
long
kvb_stride_describe(int mem_type,
                    const uint64_t *runs,
                    size_t n,
                    char *text,
                    size_t cap,
                    int *count,
                    size_t *touched) {
    const Api &a = api();
    if (!a.ok) return kNotResolved;
    if (text == nullptr || count == nullptr || touched == nullptr) return kBadArgument;
    try {
        alignas(16) unsigned char bytes[kListReserved];
        std::memset(bytes, 0x5a, sizeof bytes);
        int init = 0;
        a.ctor(bytes, &mem_type, &init);
        // to_string returns its string in memory the caller provides (the Itanium ABI's
        // hidden result pointer, passed before `this`): constructed there by the callee.
        alignas(std::string) unsigned char sbuf[sizeof(std::string)];
        std::string *made = nullptr;
        try {
            a.reserve(bytes, n);
            for (size_t i = 0; i < n; i++) {
                const uint64_t *r = runs + 5 * i;
                StrideDesc d{static_cast<uintptr_t>(r[0]),
                             static_cast<size_t>(r[1]),
                             r[2],
                             static_cast<size_t>(r[3]),
                             static_cast<size_t>(r[4])};
                a.add(bytes, &d);
            }
            *count = a.count(bytes);
            a.to_string(reinterpret_cast<std::string *>(sbuf), bytes, true);
            made = std::launder(reinterpret_cast<std::string *>(sbuf));
        }
        catch (...) {
            a.dtor(bytes);
            throw;
        }
        a.dtor(bytes);
        size_t last = 0;
        for (size_t i = 0; i < sizeof bytes; i++) {
            if (bytes[i] != 0x5a) last = i + 1;
        }
        *touched = last;
        const size_t size = made->size();
        const size_t len = size < cap ? size : (cap > 0 ? cap - 1 : 0);
        if (cap > 0) {
            std::memcpy(text, made->data(), len);
            text[len] = '\0';
        }
        made->~basic_string();
        return static_cast<long>(size);
    }
    catch (...) {
        return kException;
    }
}

// The most bytes of list object the shim allows for (checked by kvb_stride_describe).
size_t
kvb_stride_list_max(void) {
    return kListMax;
}

} // extern "C"
