package sos.hadoop;

import java.io.IOException;
import java.net.URI;
import java.util.EnumSet;
import java.util.HashSet;
import java.util.Set;

import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.fs.CreateFlag;
import org.apache.hadoop.fs.FSDataOutputStream;
import org.apache.hadoop.fs.Path;
import org.apache.hadoop.fs.permission.FsPermission;
import org.apache.hadoop.hdfs.web.WebHdfsFileSystem;
import org.apache.hadoop.util.Progressable;

/**
 * Hadoop's WebHdfsFileSystem for an {@code sos gateway}, whose files survive the gateway
 * dying while their body is in flight.
 *
 * <p>WebHDFS writes a file in one HTTP request (the data PUT after CREATE's redirect): if the
 * gateway is SIGKILLed or fails over while it runs, Hadoop's output stream throws ("Unexpected
 * end of file from server", "Connection reset") and nothing resends the body, since Hadoop's
 * retry policy covers the requests it can repeat, not a stream the caller already wrote into.
 * This one keeps a copy of every byte written (in memory up to {@code
 * sos.webhdfs.ride.memory.bytes}, 8 MiB by default, then in a local temporary file) and, when
 * the stream fails on a connection failure (or a StandbyException: the other gateway of a pair
 * took over), creates the same path again (overwrite: the writer owns its path since its
 * CREATE, as HDFS's lease gives it) and resends the whole copy, up to {@code
 * sos.webhdfs.ride.attempts} times (10) with sleeps from 0.5 s doubling up to 5 s; each new
 * CREATE goes through Hadoop's own retry or failover policy, so it waits for the gateway to
 * come back or for the standby to take over. What HDFS's client does for a DataNode lost
 * mid-write: keep the unacknowledged bytes, build a new pipeline, resend them. Any other error
 * (a refusal from the gateway: permission, quota, no parent) is thrown as before.
 *
 * <p>Only paths of the authorities in {@code sos.webhdfs.ride.authorities} (HOST:PORT of a
 * gateway, or a nameservice; empty: all) are written this way; any other URI gets plain
 * WebHdfsFileSystem behaviour.
 */
public class RideThroughWebHdfsFileSystem extends WebHdfsFileSystem {
  public static final String AUTHORITIES = "sos.webhdfs.ride.authorities";
  public static final String MEMORY = "sos.webhdfs.ride.memory.bytes";
  public static final String ATTEMPTS = "sos.webhdfs.ride.attempts";
  public static final String SLEEP_BASE = "sos.webhdfs.ride.sleep.base.millis";
  public static final String SLEEP_MAX = "sos.webhdfs.ride.sleep.max.millis";

  private boolean ride = true;
  private int memoryLimit;
  private int attempts;
  private long sleepBase;
  private long sleepMax;

  @Override
  public synchronized void initialize(URI name, Configuration conf) throws IOException {
    super.initialize(name, conf);
    Set<String> only = new HashSet<>();
    for (String a : conf.getTrimmedStrings(AUTHORITIES)) {
      only.add(a.toLowerCase());
    }
    String authority = name.getAuthority() == null ? "" : name.getAuthority().toLowerCase();
    ride = only.isEmpty() || only.contains(authority);
    memoryLimit = (int) Math.min(Integer.MAX_VALUE - 16, conf.getLong(MEMORY, 8L << 20));
    attempts = Math.max(1, conf.getInt(ATTEMPTS, 10));
    sleepBase = Math.max(0, conf.getLong(SLEEP_BASE, 500));
    sleepMax = Math.max(sleepBase, conf.getLong(SLEEP_MAX, 5000));
  }

  /** How many file bodies this JVM resent after their gateway connection failed. */
  public static long resentBodies() {
    return ResendingOutputStream.RESENT.get();
  }

  /** How many gateway connection failures this JVM met in the middle of a file's body. */
  public static long bodyFailures() {
    return ResendingOutputStream.FAILURES.get();
  }

  /** True when this instance resends bodies (its authority is one of the gateways'). */
  public boolean ridesThrough() {
    return ride;
  }

  @Override
  public FSDataOutputStream create(Path f, FsPermission permission, boolean overwrite, int bufferSize,
      short replication, long blockSize, Progressable progress) throws IOException {
    FSDataOutputStream first = super.create(f, permission, overwrite, bufferSize, replication, blockSize, progress);
    if (!ride) {
      return first;
    }
    Path qualified = makeQualified(f);
    ResendingOutputStream.Opener again = () ->
        super.create(qualified, permission, true, bufferSize, replication, blockSize, progress);
    return new FSDataOutputStream(
        new ResendingOutputStream(qualified.toString(), first, again, memoryLimit, attempts, sleepBase, sleepMax),
        null); // the inner WebHDFS streams count the bytes they send
  }

  @Override
  public FSDataOutputStream createNonRecursive(Path f, FsPermission permission, EnumSet<CreateFlag> flag,
      int bufferSize, short replication, long blockSize, Progressable progress) throws IOException {
    FSDataOutputStream first =
        super.createNonRecursive(f, permission, flag, bufferSize, replication, blockSize, progress);
    if (!ride) {
      return first;
    }
    Path qualified = makeQualified(f);
    EnumSet<CreateFlag> again = EnumSet.copyOf(flag);
    again.add(CreateFlag.OVERWRITE);
    ResendingOutputStream.Opener opener = () ->
        super.createNonRecursive(qualified, permission, again, bufferSize, replication, blockSize, progress);
    return new FSDataOutputStream(
        new ResendingOutputStream(qualified.toString(), first, opener, memoryLimit, attempts, sleepBase, sleepMax),
        null); // the inner WebHDFS streams count the bytes they send
  }
}
