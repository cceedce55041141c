/* Step-6 prototype (issue 13): the smallest compiled piece that would take the 4 KiB
 * append path out of Python. NOT part of the product; bench/proto/compiled_front.py builds
 * and measures it against the real sos-server in the same run.
 *
 *   appendfront WALDIR NAMESPACE KEY      (listens on 127.0.0.1, prints its port)
 *
 * One thread, epoll, the real wire format (protocol.md 1.2): HELLO/AUTH with the HMAC proof,
 * then APPENDs: header CRC and data CRC32C checked, offset checked against the object's
 * length, the record appended to one write-ahead log (as sos_server/wal.py does for small
 * appends: zeros written 1 MiB ahead so a sync does not also commit the file's growth), and
 * the group commit: after each epoll round, ONE fdatasync for every append of the round,
 * then their APPEND_OKs. What it leaves out (it would be the Python server's, behind it):
 * object files and checkpoints, LIST/READ/STAT/SEAL/FENCE, quotas, metrics, TLS, limits. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/crypto.h>
#include <openssl/rand.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include "sosproto.h"

#define MAX_BODY (8u * 1024 * 1024 + 4096)
#define ZEROS (1u << 20)

typedef struct {
    int fd, authed;
    uint8_t nonce[32];
    uint8_t *buf;
    size_t len, cap;
    char obj[1024];
    uint64_t obj_len;
} conn_t;

typedef struct { conn_t *c; uint32_t rid; uint64_t length; } ack_t;

static int wal_fd;
static off_t wal_off, zeroed;
static uint8_t zeros[ZEROS];
static const char *ns;
static uint8_t key_id[8], secret[32];
static ack_t *acks;
static size_t nacks, acks_cap;

static void reply(conn_t *c, int op, uint32_t rid, const uint8_t *body, uint32_t blen) {
    uint8_t f[HDR + 512];
    header(f, op, rid, blen);
    memcpy(f + HDR, body, blen);
    if (write(c->fd, f, HDR + blen) != (ssize_t)(HDR + blen)) { /* prototype: replies are tiny */ }
}

static void error_reply(conn_t *c, uint32_t rid, int code, const char *msg) {
    uint8_t b[2 + 8 + 2 + 256];
    size_t n = strlen(msg);
    put16(b, (uint16_t)code); put64(b + 2, c->obj_len); put16(b + 10, (uint16_t)n); memcpy(b + 12, msg, n);
    reply(c, OP_ERROR, rid, b, (uint32_t)(12 + n));
}

static void wal_append(const uint8_t *name, uint16_t nl, uint64_t offset, const uint8_t *data, uint32_t n, uint32_t crc) {
    uint8_t h[4 + 4 + 2 + 8];
    put32(h, n); put32(h + 4, crc); put16(h + 8, nl); put64(h + 10, offset);
    size_t need = sizeof h + nl + n;
    while (wal_off + (off_t)need > zeroed) {
        if (pwrite(wal_fd, zeros, ZEROS, zeroed) != ZEROS) { perror("pwrite zeros"); exit(2); }
        zeroed += ZEROS;
    }
    struct iovec iov[3] = {{h, sizeof h}, {(void *)name, nl}, {(void *)data, n}};
    if (pwritev(wal_fd, iov, 3, wal_off) != (ssize_t)need) { perror("pwritev"); exit(2); }
    wal_off += (off_t)need;
}

/* one complete frame at c->buf: returns 0, or -1 to close */
static int frame(conn_t *c, const uint8_t *h, const uint8_t *b, uint32_t blen) {
    uint32_t rid = get32(h + 4);
    int op = h[3];
    if (op == OP_HELLO) {
        uint8_t r[1 + 32 + 4 + 2 + 16];
        const char *srv = "appendfront";
        RAND_bytes(c->nonce, 32);
        r[0] = 1; memcpy(r + 1, c->nonce, 32); put32(r + 33, MAX_BODY);
        put16(r + 37, (uint16_t)strlen(srv)); memcpy(r + 39, srv, strlen(srv));
        reply(c, OP_HELLO_OK, rid, r, (uint32_t)(39 + strlen(srv)));
        return 0;
    }
    if (op == OP_AUTH) {
        if (blen < 8 + 2 + 32) return -1;
        uint16_t nl = get16(b + 8);
        if (blen != 8 + 2 + nl + 32u) return -1;
        uint8_t want[32];
        auth_proof(secret, c->nonce, ns, key_id, want);
        if (memcmp(b, key_id, 8) || nl != strlen(ns) || memcmp(b + 10, ns, nl) || CRYPTO_memcmp(b + 10 + nl, want, 32)) {
            error_reply(c, rid, 5, "auth failed");
            return -1;
        }
        c->authed = 1;
        uint8_t role = 2;
        reply(c, OP_AUTH_OK, rid, &role, 1);
        return 0;
    }
    if (op != OP_APPEND || !c->authed) { error_reply(c, rid, 19, "prototype: APPEND only"); return -1; }
    if (blen < 2) return -1;
    uint16_t nl = get16(b);
    if (blen < 2u + nl + 24u || nl >= sizeof c->obj) return -1;
    const uint8_t *p = b + 2 + nl;
    uint64_t offset = get64(p);
    uint32_t crc = get32(p + 16), n = get32(p + 20);
    const uint8_t *data = p + 24;
    if (2u + nl + 24u + n != blen) return -1;
    if (crc32c(0, data, n) != crc) { error_reply(c, rid, 10, "checksum mismatch"); return 0; }
    if (memcmp(c->obj, b + 2, nl) || c->obj[nl]) {  /* a new object (prototype: one per connection) */
        memcpy(c->obj, b + 2, nl); c->obj[nl] = 0; c->obj_len = 0;
    }
    if (offset != c->obj_len) { error_reply(c, rid, 9, "offset mismatch"); return 0; }
    wal_append(b + 2, nl, offset, data, n, crc);
    c->obj_len += n;
    if (nacks == acks_cap) { acks_cap = acks_cap ? 2 * acks_cap : 1024; acks = realloc(acks, acks_cap * sizeof *acks); }
    acks[nacks++] = (ack_t){c, rid, c->obj_len};
    return 0;
}

static int on_readable(conn_t *c) {
    for (;;) {
        if (c->cap - c->len < 65536) { c->cap = c->cap * 2 + 65536; c->buf = realloc(c->buf, c->cap); }
        ssize_t r = read(c->fd, c->buf + c->len, c->cap - c->len);
        if (r == 0) return -1;
        if (r < 0) { if (errno == EAGAIN) break; return -1; }
        c->len += (size_t)r;
    }
    size_t pos = 0;
    while (c->len - pos >= HDR) {
        const uint8_t *h = c->buf + pos;
        if (!header_ok(h)) return -1;
        uint32_t blen = get32(h + 8);
        if (blen > MAX_BODY) return -1;
        if (c->len - pos < HDR + blen) break;
        if (frame(c, h, h + HDR, blen) < 0) return -1;
        pos += HDR + blen;
    }
    memmove(c->buf, c->buf + pos, c->len - pos);
    c->len -= pos;
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 4) { fprintf(stderr, "usage: appendfront WALDIR NAMESPACE KEY\n"); return 2; }
    ns = argv[2];
    if (parse_key(argv[3], key_id, secret)) { fprintf(stderr, "bad key\n"); return 2; }
    char path[4096];
    snprintf(path, sizeof path, "%s/wal.log", argv[1]);
    wal_fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (wal_fd < 0) { perror(path); return 2; }
    int ls = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a = {.sin_family = AF_INET};
    inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    socklen_t al = sizeof a;
    if (bind(ls, (struct sockaddr *)&a, sizeof a) || listen(ls, 512) || getsockname(ls, (struct sockaddr *)&a, &al)) {
        perror("listen"); return 2;
    }
    printf("appendfront listening on 127.0.0.1:%d\n", ntohs(a.sin_port));
    fflush(stdout);
    int ep = epoll_create1(0);
    struct epoll_event e = {.events = EPOLLIN, .data.ptr = NULL};
    epoll_ctl(ep, EPOLL_CTL_ADD, ls, &e);
    struct epoll_event evs[512];
    for (;;) {
        int n = epoll_wait(ep, evs, 512, -1);
        for (int k = 0; k < n; k++) {
            if (evs[k].data.ptr == NULL) {
                int fd = accept4(ls, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
                if (fd < 0) continue;
                setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
                conn_t *c = calloc(1, sizeof *c);
                c->fd = fd;
                struct epoll_event ce = {.events = EPOLLIN, .data.ptr = c};
                epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ce);
                continue;
            }
            conn_t *c = evs[k].data.ptr;
            if (on_readable(c) < 0) {
                for (size_t i = 0; i < nacks; i++) if (acks[i].c == c) acks[i].c = NULL;
                close(c->fd); free(c->buf); free(c);
            }
        }
        if (nacks) {  /* the group commit: one fdatasync for the round, then the acks */
            if (fdatasync(wal_fd)) { perror("fdatasync"); return 2; }
            for (size_t i = 0; i < nacks; i++) {
                if (!acks[i].c) continue;
                uint8_t len[8];
                put64(len, acks[i].length);
                reply(acks[i].c, OP_APPEND_OK, acks[i].rid, len, 8);
            }
            nacks = 0;
        }
    }
}
