// Hadoop's own WebHDFS client writing "batches" through a nameservice of two sos gateways
// (tests/test_standby.py). Each batch i: write /ha/tmp/i (overwrite), rename it onto
// /ha/commits/i (HDFS's rename, no overwrite), then print "COMMITTED i <ms>" once the rename
// returned: what the client was told is committed. A failed attempt is retried as Spark
// retries a task (after 0.5 s, at most 40 times: -Dhawriter.attempts=N); a rename whose reply was lost is seen by
// the existence of its target. Stops after N batches or when the file STOP exists.
//
// java -cp 'pyspark/jars/*:DIR' HaWriter NAMESERVICE ADDR1,ADDR2 TOKEN_URL NAMESPACE N STOP
// (the key in $SOS_KEY; more Hadoop settings as -Dhadoop.KEY=VALUE system properties)
import java.io.File;
import java.net.URI;
import java.nio.charset.StandardCharsets;
import java.util.Map;

import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.fs.FSDataInputStream;
import org.apache.hadoop.fs.FSDataOutputStream;
import org.apache.hadoop.fs.FileSystem;
import org.apache.hadoop.fs.Path;

public class HaWriter {
  public static void main(String[] args) throws Exception {
    String ns = args[0];
    String[] addrs = args[1].split(",");
    Configuration conf = new Configuration(false);
    StringBuilder ids = new StringBuilder();
    for (int i = 0; i < addrs.length; i++) {
      String id = "gw" + (i + 1);
      ids.append(i == 0 ? "" : ",").append(id);
      conf.set("dfs.namenode.http-address." + ns + "." + id, addrs[i]);
    }
    conf.set("dfs.nameservices", ns);
    conf.set("dfs.ha.namenodes." + ns, ids.toString());
    conf.set("dfs.client.failover.proxy.provider." + ns,
        "org.apache.hadoop.hdfs.server.namenode.ha.ConfiguredFailoverProxyProvider");
    conf.set("dfs.webhdfs.oauth2.enabled", "true");
    conf.set("dfs.webhdfs.oauth2.access.token.provider",
        "org.apache.hadoop.hdfs.web.oauth2.ConfCredentialBasedAccessTokenProvider");
    conf.set("dfs.webhdfs.oauth2.client.id", args[3]);
    conf.set("dfs.webhdfs.oauth2.credential", System.getenv("SOS_KEY"));
    conf.set("dfs.webhdfs.oauth2.refresh.url", args[2]);
    for (Map.Entry<Object, Object> e : System.getProperties().entrySet()) {
      String k = e.getKey().toString();
      if (k.startsWith("hadoop.")) {
        conf.set(k.substring("hadoop.".length()), e.getValue().toString());
      }
    }
    int n = Integer.parseInt(args[4]);
    int attempts = Integer.getInteger("hawriter.attempts", 40);
    File stop = new File(args[5]);
    FileSystem fs = FileSystem.newInstance(new URI("webhdfs://" + ns), conf);
    fs.mkdirs(new Path("/ha/tmp"));
    fs.mkdirs(new Path("/ha/commits"));
    for (int i = 0; i < n && !stop.exists(); i++) {
      byte[] body = ("batch " + i + "\n").getBytes(StandardCharsets.UTF_8);
      Path tmp = new Path("/ha/tmp/" + i);
      Path dst = new Path("/ha/commits/" + i);
      for (int attempt = 1; ; attempt++) {
        try {
          if (!fs.exists(dst)) {
            try (FSDataOutputStream out = fs.create(tmp, true)) {
              out.write(body);
            }
            if (!fs.rename(tmp, dst) && !fs.exists(dst)) {
              throw new java.io.IOException("rename of " + tmp + " returned false");
            }
          }
          byte[] got = new byte[body.length];
          try (FSDataInputStream in = fs.open(dst)) {
            in.readFully(got);
          }
          if (!java.util.Arrays.equals(got, body)) {
            throw new java.io.IOException(dst + " holds the wrong bytes");
          }
          System.out.println("COMMITTED " + i + " " + System.currentTimeMillis());
          System.out.flush();
          break;
        } catch (java.io.IOException e) {
          System.out.println("RETRY " + i + " " + attempt + " " + e.toString().replace('\n', ' '));
          System.out.flush();
          if (attempt >= attempts) {
            throw e;
          }
          Thread.sleep(500);
        }
      }
    }
    fs.close();
    System.out.println("DONE");
  }
}
