/* Shared by the issue-13 step-6 prototype programs (bench/proto/, run on demand by
 * bench/proto/compiled_front.py; never shipped): the SOS frame header (protocol.md 1.2),
 * CRC32C with SSE4.2, big-endian helpers and the AUTH proof (protocol.md 1.6). */
#ifndef SOSPROTO_H
#define SOSPROTO_H

#include <errno.h>
#include <nmmintrin.h>
#include <openssl/hmac.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

enum { HDR = 16, OP_HELLO = 1, OP_AUTH = 2, OP_APPEND = 6, OP_HELLO_OK = 0x81, OP_AUTH_OK = 0x82,
       OP_APPEND_OK = 0x86, OP_ERROR = 0xff };

static inline uint32_t crc32c(uint32_t crc, const uint8_t *p, size_t n) {
    crc = ~crc;
    while (n >= 8) { uint64_t v; memcpy(&v, p, 8); crc = (uint32_t)_mm_crc32_u64(crc, v); p += 8; n -= 8; }
    while (n--) crc = _mm_crc32_u8(crc, *p++);
    return ~crc;
}

static inline void put16(uint8_t *p, uint16_t v) { p[0] = v >> 8; p[1] = v; }
static inline void put32(uint8_t *p, uint32_t v) { p[0] = v >> 24; p[1] = v >> 16; p[2] = v >> 8; p[3] = v; }
static inline void put64(uint8_t *p, uint64_t v) { put32(p, v >> 32); put32(p + 4, (uint32_t)v); }
static inline uint16_t get16(const uint8_t *p) { return (uint16_t)(p[0] << 8 | p[1]); }
static inline uint32_t get32(const uint8_t *p) { return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3]; }
static inline uint64_t get64(const uint8_t *p) { return (uint64_t)get32(p) << 32 | get32(p + 4); }

/* 16-byte header: "SO" | version 1 | opcode | request_id | body_len | CRC32C of the first 12 */
static inline void header(uint8_t *h, int op, uint32_t rid, uint32_t body_len) {
    h[0] = 'S'; h[1] = 'O'; h[2] = 1; h[3] = (uint8_t)op;
    put32(h + 4, rid); put32(h + 8, body_len); put32(h + 12, crc32c(0, h, 12));
}

static inline int header_ok(const uint8_t *h) {
    return h[0] == 'S' && h[1] == 'O' && h[2] == 1 && get32(h + 12) == crc32c(0, h, 12);
}

/* proof = HMAC-SHA256(secret, nonce || namespace || key_id) */
static inline void auth_proof(const uint8_t secret[32], const uint8_t nonce[32], const char *ns,
                       const uint8_t key_id[8], uint8_t out[32]) {
    uint8_t msg[32 + 256 + 8];
    size_t n = strlen(ns);
    memcpy(msg, nonce, 32); memcpy(msg + 32, ns, n); memcpy(msg + 32 + n, key_id, 8);
    unsigned int len = 32;
    HMAC(EVP_sha256(), secret, 32, msg, 32 + n + 8, out, &len);
}

static inline int parse_key(const char *text, uint8_t key_id[8], uint8_t secret[32]) {
    if (strlen(text) < 81 || text[16] != '.') return -1;
    for (int i = 0; i < 8; i++) if (sscanf(text + 2 * i, "%2hhx", &key_id[i]) != 1) return -1;
    for (int i = 0; i < 32; i++) if (sscanf(text + 17 + 2 * i, "%2hhx", &secret[i]) != 1) return -1;
    return 0;
}

static inline double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

#endif
