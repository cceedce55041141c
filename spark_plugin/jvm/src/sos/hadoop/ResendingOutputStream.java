package sos.hadoop;

import java.io.ByteArrayOutputStream;
import java.io.EOFException;
import java.io.File;
import java.io.FileInputStream;
import java.io.FileOutputStream;
import java.io.IOException;
import java.io.InputStream;
import java.io.InterruptedIOException;
import java.io.OutputStream;
import java.net.SocketException;
import java.net.SocketTimeoutException;
import java.net.UnknownHostException;
import java.util.concurrent.atomic.AtomicLong;

import org.apache.hadoop.fs.FSDataOutputStream;
import org.apache.hadoop.ipc.RemoteException;
import org.slf4j.Logger;
import org.slf4j.LoggerFactory;

/**
 * The output stream of {@link RideThroughWebHdfsFileSystem}: writes go to the live WebHDFS
 * stream and to a copy; when the live stream fails on a connection failure (during a write or
 * at close, where WebHDFS reads the gateway's answer), close() creates the path again and
 * resends the copy. The file is complete only when close() returns, as before.
 */
final class ResendingOutputStream extends OutputStream {
  private static final Logger LOG = LoggerFactory.getLogger(ResendingOutputStream.class);
  /** Bodies this JVM resent and completed, and connection failures it met: for the tests. */
  static final AtomicLong RESENT = new AtomicLong();
  static final AtomicLong FAILURES = new AtomicLong();

  /** A fresh stream on the same path (CREATE again, overwrite). */
  interface Opener {
    FSDataOutputStream open() throws IOException;
  }

  private final String path;
  private final Opener opener;
  private final int memoryLimit;
  private final int attempts;
  private final long sleepBase;
  private final long sleepMax;
  private FSDataOutputStream live;
  private IOException broken;
  private ByteArrayOutputStream memory = new ByteArrayOutputStream();
  private File spill;
  private OutputStream spillOut;
  private long length;
  private boolean closed;

  ResendingOutputStream(String path, FSDataOutputStream first, Opener opener, int memoryLimit, int attempts,
      long sleepBase, long sleepMax) {
    this.path = path;
    this.live = first;
    this.opener = opener;
    this.memoryLimit = memoryLimit;
    this.attempts = attempts;
    this.sleepBase = sleepBase;
    this.sleepMax = sleepMax;
  }

  /** A failure that a resend can cure: the connection (or the gateway behind it) went away. */
  static boolean isConnectionFailure(Throwable e) {
    for (Throwable t = e; t != null; t = t.getCause()) {
      if (t instanceof RemoteException) {
        String cls = ((RemoteException) t).getClassName();
        return cls.endsWith(".StandbyException") || cls.endsWith(".RetriableException");
      }
      if (t instanceof SocketException || t instanceof SocketTimeoutException || t instanceof EOFException
          || t instanceof UnknownHostException || t instanceof javax.net.ssl.SSLException) {
        return true;
      }
      String message = String.valueOf(t.getMessage());
      if (t.getClass() == IOException.class && (message.startsWith("Unexpected HTTP response: code=5")
          || message.contains("Unexpected end of file") || message.contains("Premature EOF"))) {
        return true;
      }
      if (t.getClass().getName().endsWith(".StandbyException")) {
        return true;
      }
    }
    return false;
  }

  /**
   * The gateway still holds the path for a body being written: after a connection failure
   * that is this stream's own cut request, until the gateway sees its connection closed
   * (HDFS's NameNode says the same while a dead writer's lease lasts): wait, then resend.
   */
  static boolean isOwnCutBody(Throwable e) {
    for (Throwable t = e; t != null; t = t.getCause()) {
      String cls = t instanceof RemoteException ? ((RemoteException) t).getClassName() : t.getClass().getName();
      if (cls.endsWith("AlreadyBeingCreatedException")) {
        return true;
      }
    }
    return false;
  }

  private void keep(byte[] b, int off, int len) throws IOException {
    if (spillOut == null && memory.size() + (long) len > memoryLimit) {
      spill = File.createTempFile("sos-webhdfs-ride-", ".body");
      spill.deleteOnExit();
      spillOut = new FileOutputStream(spill);
      memory.writeTo(spillOut);
      memory = null;
    }
    if (spillOut != null) {
      spillOut.write(b, off, len);
    } else {
      memory.write(b, off, len);
    }
    length += len;
  }

  private void fail(IOException e) throws IOException {
    if (!isConnectionFailure(e)) {
      throw e;
    }
    LOG.warn("{}: the gateway connection failed with {} bytes written ({}); the body will be resent",
        path, length, e.toString());
    broken = e;
    FAILURES.incrementAndGet();
    FSDataOutputStream dead = live;
    live = null;
    try {
      dead.close(); // disconnects; its error is the one above
    } catch (IOException | RuntimeException ignored) {
      // the connection is gone
    }
  }

  @Override
  public void write(int b) throws IOException {
    write(new byte[] {(byte) b}, 0, 1);
  }

  @Override
  public void write(byte[] b, int off, int len) throws IOException {
    if (closed) {
      throw new IOException(path + ": stream closed");
    }
    keep(b, off, len);
    if (live != null) {
      try {
        live.write(b, off, len);
      } catch (IOException e) {
        fail(e);
      }
    }
  }

  @Override
  public void flush() throws IOException {
    if (live != null) {
      try {
        live.flush();
      } catch (IOException e) {
        fail(e);
      }
    }
  }

  @Override
  public void close() throws IOException {
    if (closed) {
      return;
    }
    closed = true;
    try {
      if (spillOut != null) {
        spillOut.close();
      }
      if (live != null) {
        try {
          FSDataOutputStream s = live;
          live = null;
          s.close();
          return;
        } catch (IOException e) {
          if (!isConnectionFailure(e)) {
            throw e;
          }
          LOG.warn("{}: the gateway connection failed at the end of the body ({} bytes: {}); resending",
              path, length, e.toString());
          broken = e;
          FAILURES.incrementAndGet();
        }
      }
      resend();
    } finally {
      memory = null;
      if (spill != null && !spill.delete()) {
        spill.deleteOnExit();
      }
    }
  }

  private void resend() throws IOException {
    IOException last = broken;
    long sleep = sleepBase;
    for (int attempt = 1; attempt <= attempts; attempt++) {
      try {
        Thread.sleep(sleep);
      } catch (InterruptedException e) {
        Thread.currentThread().interrupt();
        InterruptedIOException stop = new InterruptedIOException(path + ": interrupted before a resend");
        stop.addSuppressed(last);
        throw stop;
      }
      sleep = Math.min(sleepMax, Math.max(1, sleep * 2));
      try {
        FSDataOutputStream s = opener.open();
        try {
          copyTo(s);
        } catch (IOException e) {
          try {
            s.close();
          } catch (IOException | RuntimeException ignored) {
            // the connection is gone
          }
          throw e;
        }
        s.close();
        RESENT.incrementAndGet();
        LOG.info("{}: resent its {} bytes (attempt {})", path, length, attempt);
        return;
      } catch (IOException e) {
        if (!isConnectionFailure(e) && !isOwnCutBody(e)) {
          e.addSuppressed(last);
          throw e;
        }
        LOG.warn("{}: resend attempt {} of {} failed: {}", path, attempt, attempts, e.toString());
        last = e;
      }
    }
    throw new IOException(path + ": the gateway connection failed and " + attempts
        + " resends of the body failed too", last);
  }

  private void copyTo(OutputStream out) throws IOException {
    if (spill == null) {
      memory.writeTo(out);
      return;
    }
    byte[] buf = new byte[64 << 10];
    try (InputStream in = new FileInputStream(spill)) {
      for (int n; (n = in.read(buf)) > 0; ) {
        out.write(buf, 0, n);
      }
    }
  }
}
