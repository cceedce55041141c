/* Load generator for the step-6 prototype (bench/proto/compiled_front.py runs it):
 *   appendload PORT NAMESPACE KEY WRITERS SIZE SECONDS
 * WRITERS connections to 127.0.0.1:PORT, each authenticated (HELLO, AUTH with the HMAC
 * proof), each appending SIZE-byte blocks to its own object with ONE append in flight
 * (send, wait for APPEND_OK, next), as bench/append.py's writers do, but in one C thread
 * with epoll so that the load generator is not what limits the rate. Prints one line:
 *   appends=N seconds=S p50_ms=X p99_ms=Y errors=E */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/socket.h>

#include "sosproto.h"

typedef struct {
    int fd;
    uint32_t rid;
    uint64_t offset;
    double sent_at;
    uint8_t rbuf[8192];
    size_t rlen;
    char name[32];
} writer_t;

static void die(const char *what) { perror(what); exit(2); }

static void read_full(int fd, uint8_t *p, size_t n) {
    while (n) {
        ssize_t r = read(fd, p, n);
        if (r <= 0) die("read (handshake)");
        p += r; n -= (size_t)r;
    }
}

static void write_full(int fd, const uint8_t *p, size_t n) {
    while (n) {
        ssize_t r = write(fd, p, n);
        if (r <= 0) die("write");
        p += r; n -= (size_t)r;
    }
}

static uint8_t *frame_in(int fd, uint8_t *hdr, uint32_t *len) {
    read_full(fd, hdr, HDR);
    if (!header_ok(hdr)) { fprintf(stderr, "bad reply header\n"); exit(2); }
    *len = get32(hdr + 8);
    uint8_t *body = malloc(*len + 1);
    read_full(fd, body, *len);
    return body;
}

static void handshake(writer_t *w, int port, const char *ns, const uint8_t key_id[8], const uint8_t secret[32]) {
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
    inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    w->fd = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(w->fd, (struct sockaddr *)&a, sizeof a) < 0) die("connect");
    int one = 1;
    setsockopt(w->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    uint8_t f[HDR + 512], hdr[HDR];
    const char *client = "appendload";
    size_t cl = strlen(client), nl = strlen(ns);
    uint32_t blen = 2 + (uint32_t)cl + 2;
    header(f, OP_HELLO, ++w->rid, blen);
    put16(f + HDR, (uint16_t)cl); memcpy(f + HDR + 2, client, cl); f[HDR + 2 + cl] = 1; f[HDR + 3 + cl] = 1;
    write_full(w->fd, f, HDR + blen);
    uint32_t len;
    uint8_t *body = frame_in(w->fd, hdr, &len);
    if (hdr[3] != OP_HELLO_OK) { fprintf(stderr, "HELLO refused\n"); exit(2); }
    uint8_t nonce[32], proof[32];
    memcpy(nonce, body + 1, 32);
    free(body);
    auth_proof(secret, nonce, ns, key_id, proof);
    blen = 8 + 2 + (uint32_t)nl + 32;
    header(f, OP_AUTH, ++w->rid, blen);
    memcpy(f + HDR, key_id, 8); put16(f + HDR + 8, (uint16_t)nl); memcpy(f + HDR + 10, ns, nl);
    memcpy(f + HDR + 10 + nl, proof, 32);
    write_full(w->fd, f, HDR + blen);
    body = frame_in(w->fd, hdr, &len);
    if (hdr[3] != OP_AUTH_OK) { fprintf(stderr, "AUTH refused: %.*s\n", (int)(len > 18 ? len - 18 : 0), body + 18); exit(2); }
    free(body);
}

static void send_append(writer_t *w, const uint8_t *data, uint32_t size, uint32_t crc) {
    uint8_t f[HDR + 64];
    size_t nl = strlen(w->name);
    uint32_t blen = 2 + (uint32_t)nl + 8 + 8 + 4 + 4 + size;
    header(f, OP_APPEND, ++w->rid ? w->rid : ++w->rid, blen);
    uint8_t *b = f + HDR;
    put16(b, (uint16_t)nl); memcpy(b + 2, w->name, nl); b += 2 + nl;
    put64(b, w->offset); put64(b + 8, 0); put32(b + 16, crc); put32(b + 20, size); b += 24;
    struct iovec iov[2] = {{f, (size_t)(b - f)}, {(void *)data, size}};
    struct msghdr m = {.msg_iov = iov, .msg_iovlen = 2};
    w->sent_at = now_s();
    ssize_t n = sendmsg(w->fd, &m, 0);
    if (n != (ssize_t)(b - f) + (ssize_t)size) die("sendmsg (short)");
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    if (argc != 7) { fprintf(stderr, "usage: appendload PORT NAMESPACE KEY WRITERS SIZE SECONDS\n"); return 2; }
    int port = atoi(argv[1]), writers = atoi(argv[4]);
    const char *ns = argv[2];
    uint32_t size = (uint32_t)atoi(argv[5]);
    double seconds = atof(argv[6]);
    uint8_t key_id[8], secret[32];
    if (parse_key(argv[3], key_id, secret)) { fprintf(stderr, "bad key\n"); return 2; }
    uint8_t *data = malloc(size);
    for (uint32_t i = 0; i < size; i++) data[i] = (uint8_t)(i * 7 + 3);
    uint32_t crc = crc32c(0, data, size);
    writer_t *ws = calloc((size_t)writers, sizeof *ws);
    int ep = epoll_create1(0);
    for (int i = 0; i < writers; i++) {
        snprintf(ws[i].name, sizeof ws[i].name, "proto/%d-%ld", i, (long)getpid());
        handshake(&ws[i], port, ns, key_id, secret);
        struct epoll_event e = {.events = EPOLLIN, .data.ptr = &ws[i]};
        epoll_ctl(ep, EPOLL_CTL_ADD, ws[i].fd, &e);
    }
    size_t cap = 1 << 22, nlat = 0;
    double *lat = malloc(cap * sizeof *lat);
    long errors = 0;
    double start = now_s(), warm = start + 0.5, stop = warm + seconds;
    long counted = 0;
    for (int i = 0; i < writers; i++) send_append(&ws[i], data, size, crc);
    struct epoll_event evs[256];
    while (now_s() < stop) {
        int n = epoll_wait(ep, evs, 256, 100);
        for (int k = 0; k < n; k++) {
            writer_t *w = evs[k].data.ptr;
            ssize_t r = read(w->fd, w->rbuf + w->rlen, sizeof w->rbuf - w->rlen);
            if (r <= 0) die("read");
            w->rlen += (size_t)r;
            while (w->rlen >= HDR) {
                uint32_t blen = get32(w->rbuf + 8);
                if (w->rlen < HDR + blen) break;
                double t = now_s();
                if (w->rbuf[3] == OP_APPEND_OK) {
                    w->offset += size;
                    if (t >= warm) { counted++; if (nlat < cap) lat[nlat++] = t - w->sent_at; }
                } else {
                    errors++;
                    fprintf(stderr, "reply opcode 0x%02x: %.*s\n", w->rbuf[3], (int)(blen > 18 ? blen - 18 : 0), w->rbuf + HDR + 18);
                    exit(2);
                }
                memmove(w->rbuf, w->rbuf + HDR + blen, w->rlen - HDR - blen);
                w->rlen -= HDR + blen;
                if (t < stop) send_append(w, data, size, crc);
            }
        }
    }
    qsort(lat, nlat, sizeof *lat, cmp);
    printf("appends=%ld seconds=%.3f p50_ms=%.3f p99_ms=%.3f errors=%ld\n", counted, seconds,
           nlat ? lat[nlat / 2] * 1e3 : 0.0, nlat ? lat[(size_t)(nlat * 0.99)] * 1e3 : 0.0, errors);
    return 0;
}
